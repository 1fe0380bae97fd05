"""Triton rotary embedding + cache write: each program takes one token's heads of q, k or v (one head
where a step has few tokens, a block of HEADS_PER_PROGRAM of one kind where it has many: a prompt
chunk's thousands of tiny programs cost 15 times the bytes they move; in the CPU's interpreter, blocks
of heads of several tokens), normalises them (q, k, where
the model has per-head norms), rotates their first R dims and stores them where they go — the
rotated q out, k and v at the token's cache slot — so the step writes its keys and values with no
intermediate (Qwen3.5's attention: one kernel where Inductor made eight). Products and sums are
rounded to the inputs' dtype one by one, as the reference's elementwise ops are."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specgraph.kernels.pdl import launch

HEADS_PER_PROGRAM = 8  # where a call has MANY_TOKENS tokens or more
MANY_TOKENS = 32
INTERPRETED_TOKENS = 16  # tokens a program takes in the CPU's interpreter (a GPU's programs take one)


@triton.jit
def _heads(src, rows, live, weight, cos, sin, d, m, eps, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr):
    """Head rows at src + rows [RB] (`live` of them), each its token's cos and sin at cos + ... [RB] ->
    [RB, BLOCK_D]: RMSNorm'd (NORM: fp32 statistics, rounded like the reference), then src[d] * cos[d]
    + rotate_half(src)[d] * sin[d] for d < R, each product rounded to src's dtype."""
    dtype = src.dtype.element_ty
    half, rotary = R // 2, d < R
    partner_d = tl.where(d < half, d + half, d - half)
    mask = live[:, None] & m[None, :]
    turning = mask & rotary[None, :]
    x = tl.load(src + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(src + rows[:, None] + partner_d[None, :], mask=turning, other=0.0).to(tl.float32)
    if NORM:
        scale = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        w, w_partner = (tl.load(weight + d, mask=m, other=0.0).to(tl.float32),
                        tl.load(weight + partner_d, mask=m & rotary, other=0.0).to(tl.float32))
        x = (w[None, :] * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        partner = (w_partner[None, :] * (partner * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    turned = tl.where((d < half)[None, :], -partner, partner)
    a = (x * tl.load(cos[:, None] + d[None, :], mask=turning, other=0.0).to(tl.float32)).to(dtype)
    b = (turned * tl.load(sin[:, None] + d[None, :], mask=turning, other=0.0).to(tl.float32)).to(dtype)
    return tl.where(rotary[None, :], (a.to(tl.float32) + b.to(tl.float32)).to(dtype), x.to(dtype))


@triton.jit
def _rope_write(q, k, v, cos, sin, slots, q_norm, k_norm, q_out, keys, values, T, H, H_KV, eps,
                s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_ct,
                s_ob, s_oh, s_ot, s_kcb, s_kch, s_kcs, s_vcb, s_vch, s_vcs,
                D: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr, TB: tl.constexpr,
                NORM: tl.constexpr, PDL: tl.constexpr):
    """A program: TB tokens' block of HB heads of one kind (q's, then k's, then v's), as [TB x HB] rows."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i_bt, block = tl.program_id(0), tl.program_id(1)
    t_blocks = tl.cdiv(T, TB)
    i_b = i_bt // t_blocks
    q_blocks, kv_blocks = tl.cdiv(H, HB), tl.cdiv(H_KV, HB)
    r = tl.arange(0, TB * HB)
    tokens = (i_bt % t_blocks) * TB + r // HB  # [TB*HB] each row's token
    in_t = tokens < T
    d = tl.arange(0, BLOCK_D)
    m = d < D
    p_cos, p_sin = cos + i_b * s_cb + tokens * s_ct, sin + i_b * s_cb + tokens * s_ct  # [TB*HB]
    if block < q_blocks:
        heads = block * HB + r % HB
        live = in_t & (heads < H)
        out = _heads(q + i_b * s_qb, tokens * s_qt + heads * s_qh, live, q_norm, p_cos, p_sin, d, m, eps, D, R, NORM)
        tl.store(q_out + i_b * s_ob + (heads * s_oh + tokens * s_ot)[:, None] + d[None, :], out,
                 mask=live[:, None] & m[None, :])
    else:
        slot = tl.load(slots + tokens, mask=in_t, other=0)  # [TB*HB]
        if block < q_blocks + kv_blocks:
            heads = (block - q_blocks) * HB + r % HB
            live = in_t & (heads < H_KV)
            out = _heads(k + i_b * s_kb, tokens * s_kt + heads * s_kh, live, k_norm, p_cos, p_sin, d, m, eps, D, R,
                         NORM)
            tl.store(keys + i_b * s_kcb + (heads * s_kch + slot * s_kcs)[:, None] + d[None, :], out,
                     mask=live[:, None] & m[None, :])
        else:
            heads = (block - q_blocks - kv_blocks) * HB + r % HB
            mask = (in_t & (heads < H_KV))[:, None] & m[None, :]
            b_v = tl.load(v + i_b * s_vb + (tokens * s_vt + heads * s_vh)[:, None] + d[None, :], mask=mask, other=0.0)
            tl.store(values + i_b * s_vcb + (heads * s_vch + slot * s_vcs)[:, None] + d[None, :], b_v, mask=mask)


@torch.library.custom_op("specgraph::rope_write", mutates_args=("keys", "values"))
def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Same signature and result as rope_write_reference (the head dimension contiguous everywhere;
    norm weights, if any, in q's dtype)."""
    (b, t, h, d), r = q.shape, cos.shape[-1]
    h_kv = k.shape[2]
    cos, sin = cos.expand(b, 1, t, r), sin.expand(b, 1, t, r)
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin, keys, values)) or cos.stride() != sin.stride():
        raise ValueError("rope_write needs the head dimension contiguous, and cos and sin laid out alike")
    norms = (q_norm, k_norm)
    if (q_norm is None) != (k_norm is None) or any(w is not None and w.dtype != q.dtype for w in norms):
        raise ValueError("rope_write takes both per-head norm weights or neither, in q's dtype")
    out = torch.empty(b, h, t, d, dtype=q.dtype, device=q.device)
    # (the CPU's interpreter, which runs programs one by one in Python, each op costing the same whatever its
    # tile: blocks of heads of INTERPRETED_TOKENS tokens a program for any call)
    hb = HEADS_PER_PROGRAM if b * t >= MANY_TOKENS or not q.is_cuda else 1
    tb = 1 if q.is_cuda else min(INTERPRETED_TOKENS, triton.next_power_of_2(t))
    _rope_write[(b * triton.cdiv(t, tb), triton.cdiv(h, hb) + 2 * triton.cdiv(h_kv, hb))](
        q, k, v, cos, sin, slots, *(q if w is None else w for w in norms), out, keys, values, t, h, h_kv, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(2),
        out.stride(0), out.stride(1), out.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), D=d, R=r, BLOCK_D=triton.next_power_of_2(d), HB=hb,
        TB=tb, NORM=q_norm is not None, **launch(q.device))
    return out


@rope_write.register_fake
def _(q, k, v, cos, sin, keys, values, slots, q_norm=None, k_norm=None, eps=0.0):
    b, t, h, d = q.shape
    return q.new_empty(b, h, t, d)
