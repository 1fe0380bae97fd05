"""Row-invariant step attention over a paged cache: a query's output has the same bits whether its
segment carries one token, a chain or a tree, whatever other segments share the forward, and
whatever blocks its request's slots live in.

The split kernel (triton.py) splits the slots a segment reads by the last one its rows see and
tiles them by slot, so a token decoded alone and the same token as a tree node (its ancestors at
other slots) sum their keys in other groups and orders. Here keys are taken in *position* order, in
tiles of BLOCK_N positions and splits of SPLIT positions that start at 0 whatever the forward: a
query at position p reads positions [0, p] in the same tiles, splits and merge order in every
forward. Everything happens in each segment's virtual slot space; a program takes the tokens of
one segment (so no other segment changes what it computes) and maps virtual slots to physical
ones through the segment's row of the block table, an address that changes no bits.

Let L = starts[r], the segment's region start. Virtual slots below L hold committed tokens at
their positions (virtual slot = position, the cache's invariant); a query's visible region offsets,
in offset order, are its path (its ancestors in the region, then itself) at positions L, L + 1,
... A tile wholly below L — or one where every query of the program sees region offsets 0, 1, ...
with no gap (a chain, a prefill chunk, one token: slot = position) — is read once for the
program's queries, through one table load (BLOCK_N divides the block size, so a tile lies in one
block); other tiles are gathered token by token along each path. Both multiply the same
[BLOCK_M, D] x [D, BLOCK_N] tiles, so a row's scores and weighted values do not depend on the way
its keys were loaded. Splits write partial (output, max, sum); a second kernel merges the splits of
each query's positions in split order. Padding tokens (past cu[R]) keep the zeros the output
starts with.

Precondition of the invariance (not of the result, which is the reference's for any layout: each
visible slot is read once): slots below L hold committed tokens at their positions, and each
token's visible region offsets are its path in order, ancestors before descendants. Tokens written
at region offsets 0..n-1 in node order (parents first) meet it: the verifier's trees, prefill
chunks, catch-ups, a recurrent drafter's re-fed steps. So do drafters whose tokens are written
past earlier-fed nodes of the same region (draft.py's levels, growing.py's expansions), since
nodes are fed after their parents.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specgraph.kernels import dot_precision
from specgraph.kernels.attention import token_major_like
from specgraph.kernels.pdl import launch

SPLIT = 128  # positions per split (H200, 21-node trees over 300-1000 positions: 128 ran faster than 64)
BLOCK_N = 32  # positions per tile: block sizes must be multiples of it
BLOCK_C = 128  # region offsets per pass when scanning a token's visible offsets


@triton.jit
def _path_extent(visible, s_vt, tok, G, valid, BLOCK_C: tl.constexpr):
    """[R] twice: how many region offsets each row's token `tok` [R] sees (its path's length), and
    1 + the last of them (0: none)."""
    count = tl.zeros_like(tok)
    reach = tl.zeros_like(tok)
    for c0 in range(0, G, BLOCK_C):
        j = c0 + tl.arange(0, BLOCK_C)
        seen = tl.load(visible + tok[:, None] * s_vt + j[None, :], mask=valid[:, None] & (j < G)[None, :], other=0)
        count += tl.sum((seen != 0).to(tl.int32), axis=1)
        reach = tl.maximum(reach, tl.max(tl.where(seen != 0, j[None, :] + 1, 0), axis=1))
    return count, reach


@triton.jit
def _path_slots(visible, s_vt, tok, valid, L, REACH, pos, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """[BN] the virtual slot at or past L that holds position `pos` [BN] on token `tok`'s path (its
    visible region offsets, all below REACH, in order), -1 where none."""
    slot = tl.full([BLOCK_N], -1, tl.int64)
    base = 0
    for c0 in range(0, REACH, BLOCK_C):
        j = c0 + tl.arange(0, BLOCK_C)
        seen = tl.load(visible + tok * s_vt + j, mask=valid & (j < REACH), other=0).to(tl.int32)  # [BC]
        rank = base + tl.cumsum(seen, axis=0)  # [BC] position - L + 1 of each seen offset
        hit = (seen[None, :] != 0) & (rank[None, :] == (pos - L + 1)[:, None])  # [BN, BC]
        slot = tl.maximum(slot, tl.max(tl.where(hit, (L + j)[None, :], -1), axis=1))
        base += tl.sum(seen, axis=0)
    return slot


@triton.jit
def _physical(p_table, block_size, slot):
    """Physical slots of the virtual slots `slot` (where >= 0) of the table row at p_table."""
    return tl.load(p_table + slot // block_size, mask=slot >= 0, other=0) * block_size + slot % block_size


@triton.jit
def _partials(q, k, v, table, seg_rows, cu, starts, visible, part_o, part_m, part_l, ends, T, G, H_KV, SPLITS,
              block_size, scale, s_qh, s_qt, s_kh, s_ks, s_vh, s_vs, s_tr, s_vt,
              GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr, SPLIT: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
              PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    BLOCK_M: tl.constexpr = TOKENS * GROUP_P2
    i_rk, i_tb, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_r, i_kv = i_rk // H_KV, i_rk % H_KV
    first = tl.load(cu + i_r)
    count = tl.load(cu + i_r + 1) - first  # the segment's tokens: first, first + 1, ...
    L = tl.load(starts + i_r)  # the segment's region start
    p_table = table + tl.load(seg_rows + i_r) * s_tr  # its request's row of the block table

    r = tl.arange(0, BLOCK_M)  # row = token of the block * GROUP_P2 + query head in the group
    i, g = i_tb * TOKENS + r // GROUP_P2, r % GROUP_P2
    valid = (i < count) & (g < GROUP)
    tok = first + i  # [BM] packed token index
    path, reach = _path_extent(visible, s_vt, tok, G, valid, BLOCK_C)  # [BM] path length from L, 1 + its last offset
    end = tl.where(valid, L + path - 1, -1)  # [BM] each row's position (the last it reads)
    contiguous = tl.min(tl.where(valid, (reach == path).to(tl.int32), 1), axis=0)  # paths at offsets 0, 1, ...: slot = position
    REACH = tl.max(reach, axis=0)  # region offsets the program's paths lie in
    row_id = tok * GROUP + g
    if (i_kv == 0) & (i_s == 0):
        tl.store(ends + row_id, end.to(tl.int32), mask=valid)
    lo = i_s * SPLIT
    hi = tl.max(end, axis=0) + 1
    # the last split also takes any position past SPLITS * SPLIT: a `width` that undercounts the
    # positions (SPLITS comes from it) leaves the result right and only the bits' invariance to lose
    hi = tl.where(i_s == SPLITS - 1, hi, tl.minimum(lo + SPLIT, hi))
    if lo < hi:
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        p_q = q + (i_kv * GROUP + g)[:, None] * s_qh + tok[:, None] * s_qt + o_d[None, :]
        b_q = tl.load(p_q, mask=valid[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BM, BD]
        k_base = k + i_kv.to(tl.int64) * s_kh  # (a pool's heads may lie 2^31 elements apart)
        v_base = v + i_kv.to(tl.int64) * s_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for p0 in range(lo, hi, BLOCK_N):
            pos = p0 + tl.arange(0, BLOCK_N)  # [BN]
            committed = pos < L
            if (p0 + BLOCK_N <= L) | (contiguous != 0):  # one tile of slots = positions for every row
                slots = tl.load(p_table + p0 // block_size) * block_size + pos % block_size  # [BN] physical: one block
                readable = pos < hi
                b_k = tl.load(k_base + slots[:, None] * s_ks + o_d[None, :], mask=readable[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                b_v = tl.load(v_base + slots[:, None] * s_vs + o_d[None, :], mask=readable[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                seen = pos[None, :] <= end[:, None]  # (a row sees every position up to its own: prefix, then path)
                b_s = tl.where(seen, tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale, float("-inf"))  # [BM, BN]
                m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                b_p = tl.exp(b_s - m_safe[:, None])
                b_pv = tl.dot(b_p, b_v, input_precision=PRECISION)  # [BM, BD]
            else:  # each token's keys along its own path
                b_s = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
                for j in tl.static_range(TOKENS):
                    i_j = i_tb * TOKENS + j
                    path_j = _path_slots(visible, s_vt, first + i_j, i_j < count, L, REACH, pos, BLOCK_N, BLOCK_C)
                    slot = tl.where(committed, pos, path_j)  # [BN] virtual, -1 off the path
                    b_k = tl.load(k_base + _physical(p_table, block_size, slot)[:, None] * s_ks + o_d[None, :],
                                  mask=(slot >= 0)[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                    mine = (r // GROUP_P2 == j)[:, None] & (slot >= 0)[None, :]
                    b_s = tl.where(mine, tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * scale, b_s)
                m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                b_p = tl.exp(b_s - m_safe[:, None])
                b_pv = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                for j in tl.static_range(TOKENS):
                    i_j = i_tb * TOKENS + j
                    path_j = _path_slots(visible, s_vt, first + i_j, i_j < count, L, REACH, pos, BLOCK_N, BLOCK_C)
                    slot = tl.where(committed, pos, path_j)
                    b_v = tl.load(v_base + _physical(p_table, block_size, slot)[:, None] * s_vs + o_d[None, :],
                                  mask=(slot >= 0)[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                    mine = (r // GROUP_P2 == j)[:, None]
                    b_pv = tl.where(mine, tl.dot(tl.where(mine, b_p, 0.0), b_v, input_precision=PRECISION), b_pv)
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(b_p, axis=1)
            acc = acc * alpha[:, None] + b_pv
            m_i = m_new
        base = (i_kv * SPLITS + i_s) * T * GROUP + row_id  # partials [Hkv, SPLITS, T * GROUP]
        tl.store(part_o + base[:, None] * D + o_d[None, :], acc, mask=valid[:, None] & m_d[None, :])
        tl.store(part_m + base, m_i, mask=valid)
        tl.store(part_l + base, l_i, mask=valid)


@triton.jit
def _merge(part_o, part_m, part_l, ends, o, cu, T, H_KV, SPLITS, s_oh, s_ot,
           GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr, SPLIT: tl.constexpr,
           D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Each query's output: its live splits' partials merged in split order."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    BLOCK_M: tl.constexpr = TOKENS * GROUP_P2
    i_rk, i_tb = tl.program_id(0), tl.program_id(1)
    i_r, i_kv = i_rk // H_KV, i_rk % H_KV
    first = tl.load(cu + i_r)
    r = tl.arange(0, BLOCK_M)
    i, g = i_tb * TOKENS + r // GROUP_P2, r % GROUP_P2
    valid = (i < tl.load(cu + i_r + 1) - first) & (g < GROUP)
    tok = first + i
    row_id = tok * GROUP + g
    end = tl.load(ends + row_id, mask=valid, other=-1)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        live = s * SPLIT <= end
        m_all = tl.maximum(m_all, tl.load(part_m + (i_kv * SPLITS + s) * T * GROUP + row_id, mask=live, other=float("-inf")))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        live = s * SPLIT <= end
        base = (i_kv * SPLITS + s) * T * GROUP + row_id
        w = tl.exp(tl.load(part_m + base, mask=live, other=float("-inf")) - m_safe)
        l_all += w * tl.load(part_l + base, mask=live, other=0.0)
        acc += w[:, None] * tl.load(part_o + base[:, None] * D + o_d[None, :], mask=live[:, None] & m_d[None, :], other=0.0)
    out = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    p_o = o + (i_kv * GROUP + g)[:, None] * s_oh + tok[:, None] * s_ot + o_d[None, :]
    tl.store(p_o, out.to(o.dtype.element_ty), mask=valid[:, None] & m_d[None, :])


@torch.library.custom_op("specgraph::attention_invariant", mutates_args=())
def attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                        rows: torch.Tensor, cu: torch.Tensor, starts: torch.Tensor, visible: torch.Tensor,
                        reach: torch.Tensor, grid: torch.Tensor, tickets: torch.Tensor, block_size: int,
                        padded: bool = True) -> torch.Tensor:
    """Same signature and result as attention_reference; each query's bits independent of its
    forward (`reach`, `grid` and `tickets` unused: its programs find their paths in `visible`; a segment's tokens are cu[r]..cu[r + 1]; the table's width, the slots a
    segment may see, only sizes the split count)."""
    _, h, t, d = q.shape
    h_kv, g = k_cache.shape[1], visible.shape[1]
    width = table.shape[1] * block_size  # (the layout cuts the table to the blocks a step may see)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1 or visible.stride(-1) != 1:
        raise ValueError("step attention needs the head dimension and the visible region offsets contiguous")
    if block_size % BLOCK_N:
        raise ValueError(f"row-invariant attention reads keys in tiles of {BLOCK_N} positions inside one block: "
                         f"the block size must be a multiple of {BLOCK_N}, not {block_size}")
    group = h // h_kv
    group_p2 = triton.next_power_of_2(group)
    tokens = max(1, 16 // group_p2)  # tokens per program: 16 rows at least, for the tensor cores
    segments, splits = rows.numel(), triton.cdiv(width, SPLIT)  # (positions are below starts[r] + G <= width)
    part_o = torch.empty(h_kv * splits * t * group, d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(h_kv * splits * t * group, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    ends = torch.empty(t * group, dtype=torch.int32, device=q.device)
    out = token_major_like(q)
    if padded:  # padding tokens: 0 (no program writes them)
        out.zero_()
    blocks = triton.cdiv(g, tokens)  # token blocks covering the largest segment
    common = dict(GROUP=group, GROUP_P2=group_p2, TOKENS=tokens, SPLIT=SPLIT, D=d,
                  BLOCK_D=max(16, triton.next_power_of_2(d)), **launch(q.device))
    _partials[(segments * h_kv, blocks, splits)](
        q, k_cache, v_cache, table, rows, cu, starts, visible.view(torch.uint8), part_o, part_m, part_l, ends, t, g,
        h_kv, splits, block_size, 1.0 / math.sqrt(d), q.stride(1), q.stride(2), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2), table.stride(0), visible.stride(0), BLOCK_N=BLOCK_N, BLOCK_C=BLOCK_C,
        PRECISION=dot_precision(q), **common)
    _merge[(segments * h_kv, blocks)](part_o, part_m, part_l, ends, out, cu, t, h_kv, splits, out.stride(1),
                                      out.stride(2), **common)
    return out


@attention_invariant.register_fake
def _(q, k_cache, v_cache, table, rows, cu, starts, visible, reach, grid, tickets, block_size, padded=True):
    return token_major_like(q)
