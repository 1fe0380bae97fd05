"""Triton tree attention: one program per (batch, query head) over all T <= 64 tree queries.

It streams the prefix keys/values in BLOCK_S tiles with an online softmax (every query sees the
whole prefix), then the T tree keys, each query keeping those whose bit is set in its ancestor
word. No mask is materialised; grouped-query heads share kv head h // GROUP.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _online_update(b_s, b_v, m_i, l_i, acc):
    """Fold scores b_s [BT, BS] (masked entries -inf) and values b_v [BS, BD] into the running state."""
    m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    b_p = tl.exp(b_s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(b_p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(b_p, b_v)
    return m_new, l_i, acc


@triton.jit
def tree_attention_kernel(
    q, k, v, anc, o, prefix_len, tree_start, T, H, scale,
    s_qb, s_qh, s_qt, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_ob, s_oh, s_ot,
    D: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    i_kvh = i_h // GROUP
    o_t = tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, BLOCK_D)
    m_t, m_d = o_t < T, o_d < D

    p_q = q + i_b * s_qb + i_h * s_qh + o_t[:, None] * s_qt + o_d[None, :]
    b_q = tl.load(p_q, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32) * scale  # [BT, BD]
    k_base = k + i_b * s_kb + i_kvh * s_kh
    v_base = v + i_b * s_vb + i_kvh * s_vh

    m_i = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for start in range(0, prefix_len, BLOCK_S):  # the committed prefix: visible to every query
        o_s = start + tl.arange(0, BLOCK_S)
        m_s = o_s < prefix_len
        b_k = tl.load(k_base + o_s[:, None] * s_ks + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
        b_v = tl.load(v_base + o_s[:, None] * s_vs + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)))  # [BT, BS]
        b_s = tl.where(m_s[None, :], b_s, float("-inf"))
        m_i, l_i, acc = _online_update(b_s, b_v.to(tl.float32), m_i, l_i, acc)

    o_j = tl.arange(0, BLOCK_T)  # the tree region: query i sees node j where bit j of anc[i] is set
    m_j = o_j < T
    b_k = tl.load(k_base + (tree_start + o_j)[:, None] * s_ks + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(v_base + (tree_start + o_j)[:, None] * s_vs + o_d[None, :], mask=m_j[:, None] & m_d[None, :], other=0.0)
    b_anc = tl.load(anc + o_t, mask=m_t, other=0)  # [BT] int64
    seen = ((b_anc[:, None] >> o_j[None, :].to(tl.int64)) & 1) == 1
    b_s = tl.dot(b_q, tl.trans(b_k.to(tl.float32)))
    b_s = tl.where(seen & m_j[None, :], b_s, float("-inf"))
    m_i, l_i, acc = _online_update(b_s, b_v.to(tl.float32), m_i, l_i, acc)

    b_o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    p_o = o + i_b * s_ob + i_h * s_oh + o_t[:, None] * s_ot + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_len: int,
                   tree_start: int, ancestor_bits: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Same signature and result as tree_attention_reference (q [B, H, T, K], caches [B, Hkv, S, K])."""
    b, h, t, d = q.shape
    if t > 64:
        raise ValueError(f"tree attention handles at most 64 tree nodes; got {t}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("tree attention needs the head dimension contiguous")
    out = torch.empty_like(q)
    grid = (b * h,)
    tree_attention_kernel[grid](
        q, k_cache, v_cache, ancestor_bits.contiguous(), out, prefix_len, tree_start, t, h,
        scale if scale is not None else 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        D=d, GROUP=h // k_cache.shape[1], BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_S=32,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
    )
    return out
