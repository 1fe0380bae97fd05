"""Triton rotary embedding + cache write: one program per (token, head of q, k or v) rotates its
head (q, k) and stores it where it goes — the rotated q out, k and v at the token's cache slot — so
the step writes its keys and values with no intermediate. Products and the sum are rounded to the
inputs' dtype one by one, as the reference's elementwise ops are."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specgraph.kernels.pdl import launch


@triton.jit
def _rotated(src, cos, sin, d, m, D: tl.constexpr):
    """src[d] * cos[d] + rotate_half(src)[d] * sin[d], each product rounded to src's dtype."""
    dtype = src.dtype.element_ty
    half = D // 2
    x = tl.load(src + d, mask=m, other=0.0).to(tl.float32)
    partner = tl.load(src + tl.where(d < half, d + half, d - half), mask=m, other=0.0).to(tl.float32)
    rotated = tl.where(d < half, -partner, partner)
    a = (x * tl.load(cos + d, mask=m, other=0.0).to(tl.float32)).to(dtype)
    b = (rotated * tl.load(sin + d, mask=m, other=0.0).to(tl.float32)).to(dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dtype)


@triton.jit
def _rope_write(q, k, v, cos, sin, slots, q_out, keys, values, T, H, H_KV,
                s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_ct,
                s_ob, s_oh, s_ot, s_kcb, s_kch, s_kcs, s_vcb, s_vch, s_vcs,
                D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i_bt, head = tl.program_id(0), tl.program_id(1)  # head: q heads, then k heads, then v heads
    i_b, i_t = i_bt // T, i_bt % T
    d = tl.arange(0, BLOCK_D)
    m = d < D
    p_cos, p_sin = cos + i_b * s_cb + i_t * s_ct, sin + i_b * s_cb + i_t * s_ct
    if head < H:
        out = _rotated(q + i_b * s_qb + i_t * s_qt + head * s_qh, p_cos, p_sin, d, m, D)
        tl.store(q_out + i_b * s_ob + head * s_oh + i_t * s_ot + d, out, mask=m)
    else:
        slot = tl.load(slots + i_t)
        if head < H + H_KV:
            h = head - H
            out = _rotated(k + i_b * s_kb + i_t * s_kt + h * s_kh, p_cos, p_sin, d, m, D)
            tl.store(keys + i_b * s_kcb + h * s_kch + slot * s_kcs + d, out, mask=m)
        else:
            h = head - H - H_KV
            b_v = tl.load(v + i_b * s_vb + i_t * s_vt + h * s_vh + d, mask=m, other=0.0)
            tl.store(values + i_b * s_vcb + h * s_vch + slot * s_vcs + d, b_v, mask=m)


@torch.library.custom_op("specgraph::rope_write", mutates_args=("keys", "values"))
def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Same signature and result as rope_write_reference (the head dimension contiguous everywhere)."""
    b, t, h, d = q.shape
    h_kv = k.shape[2]
    cos, sin = cos.expand(b, 1, t, d), sin.expand(b, 1, t, d)
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin, keys, values)) or cos.stride() != sin.stride():
        raise ValueError("rope_write needs the head dimension contiguous, and cos and sin laid out alike")
    out = torch.empty(b, h, t, d, dtype=q.dtype, device=q.device)
    _rope_write[(b * t, h + 2 * h_kv)](
        q, k, v, cos, sin, slots, out, keys, values, t, h, h_kv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(2),
        out.stride(0), out.stride(1), out.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), D=d, BLOCK_D=triton.next_power_of_2(d),
        **launch(q.device))
    return out


@rope_write.register_fake
def _(q, k, v, cos, sin, keys, values, slots):
    b, t, h, d = q.shape
    return q.new_empty(b, h, t, d)
