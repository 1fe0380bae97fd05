"""Triton step attention: split-K over the cache, query heads grouped by KV head.

Grid (B * Hkv, row blocks, splits). A program takes BLOCK_M rows of (query head in the group,
token) for one KV head, so each key/value tile is read once per group, and one split of the slots
[0, end), end = max(slots) + 1 read on the device (no host length): slots past the last written
one are never read. It keeps an online softmax over its split and writes the partial output and
its (max, sum); the last split of a row block to finish (an atomic counter, reset by it for the
next call) merges them, so one launch does the whole attention. Masked entries come from the step
mask, one byte per (token, slot) shared by every head: no per-head mask is built.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specgraph.kernels.attention import token_major_like
from specgraph.kernels.pdl import launch


# The most (query head, token) rows a program takes: a power of two, at least 16. 32, not 64: more
# programs over the keys of a tree's rows (run 71: verifying 9-31 tokens at the Llama-3-8B shape
# 0.26-0.33 ms faster a step, at the Qwen3.5-27B shape 0.11-0.18 ms).
MAX_BLOCK_M = 32


@triton.jit
def _step_attention(q, k, v, mask, slots, part_o, part_m, part_l, counters, o, T, H_KV, ROWS, scale,
             s_qb, s_qh, s_qt, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_mt, s_ob, s_oh, s_ot,
             GROUP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_T: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i_bk, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_kv = i_bk // H_KV, i_bk % H_KV
    o_t = tl.arange(0, BLOCK_T)
    end = tl.max(tl.load(slots + o_t, mask=o_t < T, other=0), axis=0) + 1  # past the last written slot
    chunk = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N
    lo = i_s * chunk
    hi = tl.minimum(lo + chunk, end)

    rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = g * T + t: query head kv*GROUP + g, token t
    m_rows = rows < ROWS
    g, t = rows // T, rows % T
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_q = q + i_b * s_qb + (i_kv * GROUP + g)[:, None] * s_qh + t[:, None] * s_qt + o_d[None, :]
    b_q = tl.load(p_q, mask=m_rows[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BM, BD]
    k_base = k + i_b * s_kb + i_kv * s_kh
    v_base = v + i_b * s_vb + i_kv * s_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        m_cols = cols < hi
        b_k = tl.load(k_base + cols[:, None] * s_ks + o_d[None, :], mask=m_cols[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_v = tl.load(v_base + cols[:, None] * s_vs + o_d[None, :], mask=m_cols[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        seen = tl.load(mask + t[:, None] * s_mt + cols[None, :], mask=m_rows[:, None] & m_cols[None, :], other=0)
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale  # [BM, BN] (fp32 operands: exact in the interpreter too)
        b_s = tl.where(seen != 0, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.exp(b_s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(b_p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(b_p, b_v)
        m_i = m_new

    base = (i_bk * SPLITS + i_s) * ROWS + rows  # partials [B * Hkv, SPLITS, ROWS]
    tl.store(part_o + base[:, None] * D + o_d[None, :], acc, mask=m_rows[:, None] & m_d[None, :])
    tl.store(part_m + base, m_i, mask=m_rows)
    tl.store(part_l + base, l_i, mask=m_rows)
    ticket = counters + i_bk * tl.num_programs(1) + i_m
    tl.debug_barrier()  # every thread's partial stores precede the ticket's release
    if tl.atomic_add(ticket, 1) == SPLITS - 1:  # acq_rel: the other splits' partials are visible
        tl.atomic_xchg(ticket, 0)
        _merge(part_o, part_m, part_l, o, i_b, i_kv, i_bk, rows, m_rows, T, ROWS, s_ob, s_oh, s_ot,
               GROUP, SPLITS, BLOCK_M, D, BLOCK_D)


@triton.jit
def _merge(part_o, part_m, part_l, o, i_b, i_kv, i_bk, rows, m_rows, T, ROWS, s_ob, s_oh, s_ot,
           GROUP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the SPLITS partial (output, max, sum) of `rows` and store the normalised output."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m_all = tl.maximum(m_all, tl.load(part_m + (i_bk * SPLITS + s) * ROWS + rows, mask=m_rows, other=float("-inf")))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        base = (i_bk * SPLITS + s) * ROWS + rows
        w = tl.exp(tl.load(part_m + base, mask=m_rows, other=float("-inf")) - m_safe)  # empty splits weigh 0
        l_all += w * tl.load(part_l + base, mask=m_rows, other=0.0)
        acc += w[:, None] * tl.load(part_o + base[:, None] * D + o_d[None, :], mask=m_rows[:, None] & m_d[None, :], other=0.0)
    out = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    g, t = rows // T, rows % T
    p_o = o + i_b * s_ob + (i_kv * GROUP + g)[:, None] * s_oh + t[:, None] * s_ot + o_d[None, :]
    tl.store(p_o, out.to(o.dtype.element_ty), mask=m_rows[:, None] & m_d[None, :])


# Tickets of the split programs (the last of a row block's splits merges them), zero between calls:
# one table per device, size and stream, as launches on one stream run one after the other and
# launches on different streams may overlap. (A CUDA graph keeps the table of the stream it was
# captured on: replay graphs captured on one stream on one stream at a time.)
_TICKETS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


@torch.library.custom_op("specgraph::attention", mutates_args=())
def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
              slots: torch.Tensor) -> torch.Tensor:
    """Same signature and result as attention_reference."""
    b, h, t, d = q.shape
    h_kv, width = k_cache.shape[1], mask.shape[1]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1 or mask.stride(-1) != 1:
        raise ValueError("step attention needs the head dimension and the mask's slots contiguous")
    group = h // h_kv
    rows = group * t
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))
    splits = max(1, min(16, width // 256))  # the keys actually read are fewer: [0, max(slots)]
    part_o = torch.empty(b * h_kv * splits * rows, d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(b * h_kv * splits * rows, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    out = token_major_like(q)
    row_blocks = triton.cdiv(rows, block_m)
    stream = torch.cuda.current_stream(q.device).stream_id if q.is_cuda else 0
    key = (q.device, b * h_kv * row_blocks, stream)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(key[1], dtype=torch.int32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    _step_attention[(b * h_kv, row_blocks, splits)](
        q, k_cache, v_cache, mask.view(torch.uint8), slots, part_o, part_m, part_l, _TICKETS[key], out,
        t, h_kv, rows, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), mask.stride(0), out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=32, BLOCK_T=max(16, triton.next_power_of_2(t)),
        D=d, BLOCK_D=block_d, **launch(q.device))
    return out


@attention.register_fake
def _(q, k_cache, v_cache, mask, slots):
    return token_major_like(q)
