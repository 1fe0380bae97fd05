"""Triton rotary embedding + cache write: one program per (token, head of q, k or v) normalises
its head (q, k, where the model has per-head norms), rotates its first R dims and stores it where
it goes — the rotated q out, k and v at the token's cache slot — so the step writes its keys and
values with no intermediate (Qwen3.5's attention: one kernel where Inductor made eight). Products
and sums are rounded to the inputs' dtype one by one, as the reference's elementwise ops are."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specgraph.kernels.pdl import launch


@triton.jit
def _head(src, weight, cos, sin, d, m, eps, D: tl.constexpr, R: tl.constexpr, NORM: tl.constexpr):
    """One head [BLOCK_D]: RMSNorm'd (NORM: fp32 statistics, rounded like the reference), then
    src[d] * cos[d] + rotate_half(src)[d] * sin[d] for d < R, each product rounded to src's dtype."""
    dtype = src.dtype.element_ty
    half, rotary = R // 2, d < R
    partner_d = tl.where(d < half, d + half, d - half)
    x = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
    partner = tl.load(src + partner_d, mask=m & rotary, other=0.0).to(tl.float32)
    if NORM:
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        x = (tl.load(weight + d, mask=m, other=0.0).to(tl.float32) * (x * scale).to(dtype).to(tl.float32)).to(dtype)
        partner = (tl.load(weight + partner_d, mask=m & rotary, other=0.0).to(tl.float32)
                   * (partner * scale).to(dtype).to(tl.float32)).to(dtype)
        x, partner = x.to(tl.float32), partner.to(tl.float32)
    turned = tl.where(d < half, -partner, partner)
    a = (x * tl.load(cos + d, mask=m & rotary, other=0.0).to(tl.float32)).to(dtype)
    b = (turned * tl.load(sin + d, mask=m & rotary, other=0.0).to(tl.float32)).to(dtype)
    return tl.where(rotary, (a.to(tl.float32) + b.to(tl.float32)).to(dtype), x.to(dtype))


@triton.jit
def _rope_write(q, k, v, cos, sin, slots, q_norm, k_norm, q_out, keys, values, T, H, H_KV, eps,
                s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_ct,
                s_ob, s_oh, s_ot, s_kcb, s_kch, s_kcs, s_vcb, s_vch, s_vcs,
                D: tl.constexpr, R: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i_bt, head = tl.program_id(0), tl.program_id(1)  # head: q heads, then k heads, then v heads
    i_b, i_t = i_bt // T, i_bt % T
    d = tl.arange(0, BLOCK_D)
    m = d < D
    p_cos, p_sin = cos + i_b * s_cb + i_t * s_ct, sin + i_b * s_cb + i_t * s_ct
    if head < H:
        out = _head(q + i_b * s_qb + i_t * s_qt + head * s_qh, q_norm, p_cos, p_sin, d, m, eps, D, R, NORM)
        tl.store(q_out + i_b * s_ob + head * s_oh + i_t * s_ot + d, out, mask=m)
    else:
        slot = tl.load(slots + i_t)
        if head < H + H_KV:
            h = head - H
            out = _head(k + i_b * s_kb + i_t * s_kt + h * s_kh, k_norm, p_cos, p_sin, d, m, eps, D, R, NORM)
            tl.store(keys + i_b * s_kcb + h * s_kch + slot * s_kcs + d, out, mask=m)
        else:
            h = head - H - H_KV
            b_v = tl.load(v + i_b * s_vb + i_t * s_vt + h * s_vh + d, mask=m, other=0.0)
            tl.store(values + i_b * s_vcb + h * s_vch + slot * s_vcs + d, b_v, mask=m)


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
    _rope_write[(b * t, h + 2 * h_kv)](
        q, k, v, cos, sin, slots, *(q if w is None else w for w in norms), out, keys, values, t, h, h_kv, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(2),
        out.stride(0), out.stride(1), out.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), D=d, R=r, BLOCK_D=triton.next_power_of_2(d),
        NORM=q_norm is not None, **launch(q.device))
    return out


@rope_write.register_fake
def _(q, k, v, cos, sin, keys, values, slots, q_norm=None, k_norm=None, eps=0.0):
    b, t, h, d = q.shape
    return q.new_empty(b, h, t, d)
