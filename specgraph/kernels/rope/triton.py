"""Triton rotary embedding + cache write: each program takes one token's heads of q, k or v (one head
where a step has few tokens, a block of HEADS_PER_PROGRAM of one kind where it has many: a prompt
chunk's thousands of tiny programs cost 15 times the bytes they move), normalises them (q, k, where
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


@triton.jit
def _heads(src, s_h, heads, live, weight, cos, sin, d, m, eps, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr):
    """Heads `heads` [HB] (`live` of them; rows s_h apart from src) -> [HB, BLOCK_D]: RMSNorm'd (NORM:
    fp32 statistics, rounded like the reference), then src[d] * cos[d] + rotate_half(src)[d] * sin[d]
    for d < R, each product rounded to src's dtype."""
    dtype = src.dtype.element_ty
    half, rotary = R // 2, d < R
    partner_d = tl.where(d < half, d + half, d - half)
    rows, mask = heads[:, None] * s_h, live[:, None] & m[None, :]
    x = tl.load(src + rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(src + rows + partner_d[None, :], mask=mask & rotary[None, :], other=0.0).to(tl.float32)
    if NORM:
        scale = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        w, w_partner = (tl.load(weight + d, mask=m, other=0.0).to(tl.float32),
                        tl.load(weight + partner_d, mask=m & rotary, other=0.0).to(tl.float32))
        x = (w[None, :] * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        partner = (w_partner[None, :] * (partner * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    turned = tl.where((d < half)[None, :], -partner, partner)
    a = (x * tl.load(cos + d, mask=m & rotary, other=0.0).to(tl.float32)[None, :]).to(dtype)
    b = (turned * tl.load(sin + d, mask=m & rotary, other=0.0).to(tl.float32)[None, :]).to(dtype)
    return tl.where(rotary[None, :], (a.to(tl.float32) + b.to(tl.float32)).to(dtype), x.to(dtype))


@triton.jit
def _rope_write(q, k, v, cos, sin, slots, q_norm, k_norm, q_out, keys, values, T, H, H_KV, eps,
                s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_ct,
                s_ob, s_oh, s_ot, s_kcb, s_kch, s_kcs, s_vcb, s_vch, s_vcs,
                D: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr, NORM: tl.constexpr,
                PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i_bt, block = tl.program_id(0), tl.program_id(1)  # blocks of HB heads: q's, then k's, then v's
    i_b, i_t = i_bt // T, i_bt % T
    q_blocks, kv_blocks = tl.cdiv(H, HB), tl.cdiv(H_KV, HB)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    p_cos, p_sin = cos + i_b * s_cb + i_t * s_ct, sin + i_b * s_cb + i_t * s_ct
    if block < q_blocks:
        heads = block * HB + tl.arange(0, HB)
        live = heads < H
        out = _heads(q + i_b * s_qb + i_t * s_qt, s_qh, heads, live, q_norm, p_cos, p_sin, d, m, eps, D, R, NORM)
        tl.store(q_out + i_b * s_ob + heads[:, None] * s_oh + i_t * s_ot + d[None, :], out,
                 mask=live[:, None] & m[None, :])
    else:
        slot = tl.load(slots + i_t)
        if block < q_blocks + kv_blocks:
            heads = (block - q_blocks) * HB + tl.arange(0, HB)
            live = heads < H_KV
            out = _heads(k + i_b * s_kb + i_t * s_kt, s_kh, heads, live, k_norm, p_cos, p_sin, d, m, eps, D, R, NORM)
            tl.store(keys + i_b * s_kcb + heads[:, None] * s_kch + slot * s_kcs + d[None, :], out,
                     mask=live[:, None] & m[None, :])
        else:
            heads = (block - q_blocks - kv_blocks) * HB + tl.arange(0, HB)
            mask = (heads < H_KV)[:, None] & m[None, :]
            b_v = tl.load(v + i_b * s_vb + i_t * s_vt + heads[:, None] * s_vh + d[None, :], mask=mask, other=0.0)
            tl.store(values + i_b * s_vcb + heads[:, None] * s_vch + slot * s_vcs + d[None, :], b_v, mask=mask)


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
    # (the CPU's interpreter, which runs programs one by one in Python, takes blocks of heads for any call)
    hb = HEADS_PER_PROGRAM if b * t >= MANY_TOKENS or not q.is_cuda else 1
    _rope_write[(b * t, triton.cdiv(h, hb) + 2 * triton.cdiv(h_kv, hb))](
        q, k, v, cos, sin, slots, *(q if w is None else w for w in norms), out, keys, values, t, h, h_kv, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(2),
        out.stride(0), out.stride(1), out.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), D=d, R=r, BLOCK_D=triton.next_power_of_2(d), HB=hb,
        NORM=q_norm is not None, **launch(q.device))
    return out


@rope_write.register_fake
def _(q, k, v, cos, sin, keys, values, slots, q_norm=None, k_norm=None, eps=0.0):
    b, t, h, d = q.shape
    return q.new_empty(b, h, t, d)
