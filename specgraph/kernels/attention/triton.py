"""Triton step attention over a paged cache: split-K, query heads grouped by KV head.

Grid (R * Hkv, row blocks, splits). A program takes BLOCK_M rows of (token, query head in the
group) of ONE segment r for one KV head, so each key/value tile is read once for the group and
the segment's tokens, and one split of that segment's virtual slots [0, end): end = starts[r] + the
largest reach (1 + the last region offset seen: Layout.attention_inputs) of its rows, read on the
device (no host length: nothing past what its rows can see is read, and an early row block of a
prefill chunk stops before the later tokens).
Virtual slots are taken in tiles of BLOCK_N that lie in one block (block_size % BLOCK_N == 0), so
a tile's physical rows cost one load of the block table. A (token, virtual slot) is seen below
starts[r] (the segment's committed prefix: no mask is read there) and at the region offsets
`visible` marks, one byte per (token, offset) shared by every head: no per-head mask is built.
Each split keeps an online softmax and writes its partial output and (max, sum); the last split of
a row block to finish (an atomic ticket in the caller's scratch, reset by it for the next layer)
merges them, so one launch does the whole attention. Padding tokens (past cu[R]) keep the zeros the output starts with.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specgraph.kernels import dot_precision
from specgraph.kernels.attention import token_major_like
from specgraph.kernels.pdl import launch


# The most (token, query head) rows a program takes: a power of two, at least 16. 32, not 64: more
# programs over the keys of a tree's rows (run 71: verifying 9-31 tokens at the Llama-3-8B shape
# 0.26-0.33 ms faster a step, at the Qwen3.5-27B shape 0.11-0.18 ms).
MAX_BLOCK_M = 32
BLOCK_N = 32  # virtual slots per key tile: block sizes must be multiples of it


@triton.jit
def _step_attention(q, k, v, table, seg_rows, cu, starts, visible, reach, part_o, part_m, part_l, counters, o,
                    T, H_KV, block_size, scale, s_qh, s_qt, s_kh, s_ks, s_vh, s_vs, s_tr, s_vt, s_oh, s_ot,
                    GROUP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    i_rk, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_r, i_kv = i_rk // H_KV, i_rk % H_KV
    first = tl.load(cu + i_r)
    n_rows = (tl.load(cu + i_r + 1) - first) * GROUP
    if i_m * BLOCK_M < n_rows:  # (row blocks cover the largest segment: a smaller one's last are empty)
        rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row = i * GROUP + g: the segment's token i, query head kv*GROUP + g
        m_rows = rows < n_rows
        tok, g = first + rows // GROUP, rows % GROUP  # [BM] packed token index, head in the group
        start = tl.load(starts + i_r)  # the segment's region: virtual slots start + offset
        p_table = table + tl.load(seg_rows + i_r) * s_tr  # its request's row of the block table
        end = start + tl.max(tl.load(reach + tok, mask=m_rows, other=0), axis=0)  # past the last slot a row sees
        chunk = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N  # whole tiles: none straddles two blocks
        lo = i_s * chunk
        hi = tl.minimum(lo + chunk, end)

        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        p_q = q + (i_kv * GROUP + g)[:, None] * s_qh + tok[:, None] * s_qt + o_d[None, :]
        b_q = tl.load(p_q, mask=m_rows[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BM, BD]
        k_base = k + i_kv.to(tl.int64) * s_kh  # (a pool's heads may lie 2^31 elements apart)
        v_base = v + i_kv.to(tl.int64) * s_vh

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)  # [BN] virtual slots
            m_cols = cols < hi
            slots = tl.load(p_table + n0 // block_size) * block_size + cols % block_size  # [BN] physical: one block
            b_k = tl.load(k_base + slots[:, None] * s_ks + o_d[None, :], mask=m_cols[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            b_v = tl.load(v_base + slots[:, None] * s_vs + o_d[None, :], mask=m_cols[:, None] & m_d[None, :], other=0.0).to(tl.float32)
            offset = cols - start  # [BN] region offset; below 0 the prefix, seen by every token
            region = m_cols & (offset >= 0)
            seen = tl.load(visible + tok[:, None] * s_vt + offset[None, :], mask=m_rows[:, None] & region[None, :], other=0)
            seen = (seen != 0) | (m_cols & (offset < 0))[None, :]  # [BM, BN]
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale  # [BM, BN]
            b_s = tl.where(seen, b_s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            b_p = tl.exp(b_s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(b_p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(b_p, b_v, input_precision=PRECISION)
            m_i = m_new

        base = ((i_kv * SPLITS + i_s) * T + tok) * GROUP + g  # partials [Hkv, SPLITS, T, GROUP]
        tl.store(part_o + base[:, None] * D + o_d[None, :], acc, mask=m_rows[:, None] & m_d[None, :])
        tl.store(part_m + base, m_i, mask=m_rows)
        tl.store(part_l + base, l_i, mask=m_rows)
        ticket = counters + i_rk * tl.num_programs(1) + i_m
        tl.debug_barrier()  # every thread's partial stores precede the ticket's release
        if tl.atomic_add(ticket, 1) == SPLITS - 1:  # acq_rel: the other splits' partials are visible
            tl.atomic_xchg(ticket, 0)
            _merge(part_o, part_m, part_l, o, i_kv, tok, g, m_rows, T, s_oh, s_ot, GROUP, SPLITS, BLOCK_M, D, BLOCK_D)


@triton.jit
def _merge(part_o, part_m, part_l, o, i_kv, tok, g, m_rows, T, s_oh, s_ot,
           GROUP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the SPLITS partial (output, max, sum) of the rows (tokens `tok`, heads `g` of the
    group) and store the normalised output."""
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        base = ((i_kv * SPLITS + s) * T + tok) * GROUP + g
        m_all = tl.maximum(m_all, tl.load(part_m + base, mask=m_rows, other=float("-inf")))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        base = ((i_kv * SPLITS + s) * T + tok) * GROUP + g
        w = tl.exp(tl.load(part_m + base, mask=m_rows, other=float("-inf")) - m_safe)  # empty splits weigh 0
        l_all += w * tl.load(part_l + base, mask=m_rows, other=0.0)
        acc += w[:, None] * tl.load(part_o + base[:, None] * D + o_d[None, :], mask=m_rows[:, None] & m_d[None, :], other=0.0)
    out = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    p_o = o + (i_kv * GROUP + g)[:, None] * s_oh + tok[:, None] * s_ot + o_d[None, :]
    tl.store(p_o, out.to(o.dtype.element_ty), mask=m_rows[:, None] & m_d[None, :])


def split_count(programs: int, width: int, device: torch.device) -> int:
    """Splits of each row block's virtual slots, for a grid of `programs` row blocks: one per 256 of the
    `width` slots a segment may see, at most 16, and on a GPU no more than bring the grid to about four
    programs a multiprocessor (a decode step's few row blocks need splits; a prompt chunk's many fill the
    GPU alone, and each split writes partials of its rows that the merge reads back)."""
    most = max(1, min(16, width // 256))  # (width bounds the slots read, which are fewer: up to the last one seen)
    if device.type != "cuda":
        return most
    return max(1, min(most, -(-4 * torch.cuda.get_device_properties(device).multi_processor_count // programs)))


@torch.library.custom_op("specgraph::attention", mutates_args=())
def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
              cu: torch.Tensor, starts: torch.Tensor, visible: torch.Tensor, reach: torch.Tensor, grid: torch.Tensor,
              tickets: torch.Tensor, block_size: int, padded: bool = True) -> torch.Tensor:
    """Same signature and result as attention_reference (`grid` unused: a segment's tokens are
    cu[r]..cu[r + 1]; the table's width, the slots a segment may see, only sizes the split count).
    `tickets`: zeros, counted up by the split programs of each row block and left zero again (so
    the op mutates nothing it does not restore)."""
    _, h, t, d = q.shape
    h_kv, g = k_cache.shape[1], visible.shape[1]
    width = table.shape[1] * block_size  # (the layout cuts the table to the blocks a step may see)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1 or visible.stride(-1) != 1:
        raise ValueError("step attention needs the head dimension and the visible region offsets contiguous")
    if block_size % BLOCK_N:
        raise ValueError(f"step attention reads keys in tiles of {BLOCK_N} virtual slots inside one block: "
                         f"the block size must be a multiple of {BLOCK_N}, not {block_size}")
    group = h // h_kv
    segments = rows.numel()
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(group * g)))
    row_blocks = triton.cdiv(group * g, block_m)
    splits = split_count(segments * h_kv * row_blocks, width, q.device)
    part_o = torch.empty(h_kv * splits * t * group, d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(h_kv * splits * t * group, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    out = token_major_like(q)
    if padded:  # padding tokens: 0 (no program writes them)
        out.zero_()
    assert tickets.numel() >= segments * h_kv * row_blocks, "tickets: Layout.attention_inputs(heads) sizes them"
    _step_attention[(segments * h_kv, row_blocks, splits)](
        q, k_cache, v_cache, table, rows, cu, starts, visible.view(torch.uint8), reach, part_o, part_m, part_l, tickets,
        out, t, h_kv, block_size, 1.0 / math.sqrt(d), q.stride(1), q.stride(2), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), table.stride(0), visible.stride(0), out.stride(1), out.stride(2),
        GROUP=group, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=BLOCK_N, D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)), PRECISION=dot_precision(q), **launch(q.device))
    return out


@attention.register_fake
def _(q, k_cache, v_cache, table, rows, cu, starts, visible, reach, grid, tickets, block_size, padded=True):
    return token_major_like(q)
