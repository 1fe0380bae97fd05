"""Row-invariant step attention: a query's output has the same bits whether its step carries one
token, a chain or a tree.

The split kernel (triton.py) splits the slots a step reads by its last written slot and tiles them
by slot, so a token decoded alone and the same token as a tree node (its ancestors at other slots)
sum their keys in other groups and orders. Here keys are taken in *position* order, in tiles of
BLOCK_N positions and splits of SPLIT positions that start at 0 whatever the step: a query at
position p reads positions [0, p] in the same tiles, splits and merge order in every step.

Let L be the step's first slot (the least of `slots`). Slots below L hold committed tokens at
their positions (slot = position, the target's cache invariant); a query's visible slots from L on
are its path through the step's tokens (its ancestors and itself, each at most its own slot), at
positions L, L + 1, ... in slot order. A tile wholly below L — or one where every query of the
program sees all slots from L to its own (a chain, a prefill chunk, one token) — is read once for
the program's queries; other tiles are gathered token by token along each path. Both multiply the
same [BLOCK_M, D] x [D, BLOCK_N] tiles, so a row's scores and weighted values do not depend on the
way its keys were loaded. Splits write partial (output, max, sum); a second kernel merges the
splits of each query's positions in split order.

Precondition (every caller's steps meet it): tokens of a step are written at slots [L, L + T) and
see, past L, no slot after their own. Drafters' steps whose ancestors lie between the committed
prefix and L still attend correctly (each visible slot is read once); only the bits' invariance
needs slot = position below L.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specgraph.kernels.attention import token_major_like
from specgraph.kernels.pdl import launch

SPLIT = 128  # positions per split (H200, 21-node trees over 300-1000 positions: 128 ran faster than 64)
BLOCK_N = 32  # positions per tile
BLOCK_C = 128  # slots per pass when scanning a step's tail


@triton.jit
def _tail_count(mask, s_mt, tok, L, TAIL, W, valid, BLOCK_C: tl.constexpr):
    """[R] how many of the slots [L, L + TAIL) each row's token `tok` [R] sees."""
    count = tl.zeros_like(tok)
    for c0 in range(0, TAIL, BLOCK_C):
        i = c0 + tl.arange(0, BLOCK_C)
        cols = L + i
        seen = tl.load(mask + tok[:, None] * s_mt + cols[None, :],
                       mask=valid[:, None] & ((i < TAIL) & (cols < W))[None, :], other=0)
        count += tl.sum(seen.to(tl.int32), axis=1)
    return count


@triton.jit
def _path_slots(mask, s_mt, tok, L, TAIL, W, pos, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """[BN] the slot at or past L that holds position `pos` [BN] on token `tok`'s path, -1 where none."""
    slot = tl.full([BLOCK_N], -1, tl.int32)
    base = 0
    for c0 in range(0, TAIL, BLOCK_C):
        i = c0 + tl.arange(0, BLOCK_C)
        seen = tl.load(mask + tok * s_mt + L + i, mask=(i < TAIL) & (L + i < W), other=0).to(tl.int32)  # [BC]
        rank = base + tl.cumsum(seen, axis=0)  # [BC] position - L + 1 of each seen slot
        hit = (seen[None, :] != 0) & (rank[None, :] == (pos - L + 1)[:, None])  # [BN, BC]
        slot = tl.maximum(slot, tl.max(tl.where(hit, (L + i)[None, :], -1), axis=1))
        base += tl.sum(seen, axis=0)
    return slot


@triton.jit
def _partials(q, k, v, mask, slots, part_o, part_m, part_l, ends, T, H_KV, W, ROWS, SPLITS, scale,
              s_qb, s_qh, s_qt, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_mt,
              GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr, SPLIT: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr,
              BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    BLOCK_M: tl.constexpr = TOKENS * GROUP_P2
    i_bk, i_tb, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_kv = i_bk // H_KV, i_bk % H_KV
    o_t = tl.arange(0, BLOCK_T)
    b_slots = tl.load(slots + o_t, mask=o_t < T, other=0)
    L = tl.min(tl.where(o_t < T, b_slots, W), axis=0).to(tl.int32)  # the step's first slot
    TAIL = tl.max(tl.where(o_t < T, b_slots, 0), axis=0).to(tl.int32) - L + 1  # slots the step writes

    r = tl.arange(0, BLOCK_M)  # row = token block offset * GROUP_P2 + query head in the group
    tok, g = i_tb * TOKENS + r // GROUP_P2, r % GROUP_P2
    valid = (tok < T) & (g < GROUP)
    count = _tail_count(mask, s_mt, tok, L, TAIL, W, valid, BLOCK_C)  # [BM] path length from L
    end = tl.where(valid, L + count - 1, -1)  # [BM] each row's position (the last it reads)
    own = tl.load(slots + tok, mask=valid, other=0).to(tl.int32)
    contiguous = tl.min(tl.where(valid, (own - L == count - 1).to(tl.int32), 1), axis=0)  # paths at slot = position
    row_id = tok * GROUP + g
    if (i_bk == 0) & (i_s == 0):
        tl.store(ends + row_id, end, mask=valid)
    lo = i_s * SPLIT
    hi = tl.minimum(lo + SPLIT, tl.max(end, axis=0) + 1)
    if lo < hi:
        o_d = tl.arange(0, BLOCK_D)
        m_d = o_d < D
        p_q = q + i_b * s_qb + (i_kv * GROUP + g)[:, None] * s_qh + tok[:, None] * s_qt + o_d[None, :]
        b_q = tl.load(p_q, mask=valid[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BM, BD]
        k_base = k + i_b * s_kb + i_kv * s_kh
        v_base = v + i_b * s_vb + i_kv * s_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for p0 in range(lo, hi, BLOCK_N):
            pos = p0 + tl.arange(0, BLOCK_N)  # [BN]
            committed = pos < L
            if (p0 + BLOCK_N <= L) | (contiguous != 0):  # one tile of slots = positions for every row
                readable = pos < hi
                b_k = tl.load(k_base + pos[:, None] * s_ks + o_d[None, :], mask=readable[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                b_v = tl.load(v_base + pos[:, None] * s_vs + o_d[None, :], mask=readable[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                seen = tl.load(mask + tok[:, None] * s_mt + pos[None, :], mask=valid[:, None] & committed[None, :], other=0) != 0
                seen = seen | (~committed[None, :] & (pos[None, :] <= end[:, None]))
                b_s = tl.where(seen, tl.dot(b_q, tl.trans(b_k)) * scale, float("-inf"))  # [BM, BN]
                m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                b_p = tl.exp(b_s - m_safe[:, None])
                b_pv = tl.dot(b_p, b_v)  # [BM, BD]
            else:  # each token's keys along its own path
                b_s = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
                for j in tl.static_range(TOKENS):
                    tok_j = i_tb * TOKENS + j
                    slot = tl.where(committed, pos, _path_slots(mask, s_mt, tok_j, L, TAIL, W, pos, BLOCK_N, BLOCK_C))
                    seen_j = tl.load(mask + tok_j * s_mt + pos, mask=committed & (tok_j < T), other=0) != 0
                    seen_j = seen_j | (~committed & (slot >= 0))
                    b_k = tl.load(k_base + slot[:, None] * s_ks + o_d[None, :], mask=(slot >= 0)[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                    mine = (r // GROUP_P2 == j)[:, None] & seen_j[None, :]
                    b_s = tl.where(mine, tl.dot(b_q, tl.trans(b_k)) * scale, b_s)
                m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                b_p = tl.exp(b_s - m_safe[:, None])
                b_pv = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
                for j in tl.static_range(TOKENS):
                    tok_j = i_tb * TOKENS + j
                    slot = tl.where(committed, pos, _path_slots(mask, s_mt, tok_j, L, TAIL, W, pos, BLOCK_N, BLOCK_C))
                    b_v = tl.load(v_base + slot[:, None] * s_vs + o_d[None, :], mask=(slot >= 0)[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                    mine = (r // GROUP_P2 == j)[:, None]
                    b_pv = tl.where(mine, tl.dot(tl.where(mine, b_p, 0.0), b_v), b_pv)
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(b_p, axis=1)
            acc = acc * alpha[:, None] + b_pv
            m_i = m_new
        base = (i_bk * SPLITS + i_s) * ROWS + row_id  # partials [B * Hkv, SPLITS, ROWS]
        tl.store(part_o + base[:, None] * D + o_d[None, :], acc, mask=valid[:, None] & m_d[None, :])
        tl.store(part_m + base, m_i, mask=valid)
        tl.store(part_l + base, l_i, mask=valid)


@triton.jit
def _merge(part_o, part_m, part_l, ends, o, T, ROWS, SPLITS, s_ob, s_oh, s_ot, H_KV,
           GROUP: tl.constexpr, GROUP_P2: tl.constexpr, TOKENS: tl.constexpr, SPLIT: tl.constexpr,
           D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Each query's output: its live splits' partials merged in split order."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    BLOCK_M: tl.constexpr = TOKENS * GROUP_P2
    i_bk, i_tb = tl.program_id(0), tl.program_id(1)
    i_b, i_kv = i_bk // H_KV, i_bk % H_KV
    r = tl.arange(0, BLOCK_M)
    tok, g = i_tb * TOKENS + r // GROUP_P2, r % GROUP_P2
    valid = (tok < T) & (g < GROUP)
    row_id = tok * GROUP + g
    end = tl.load(ends + row_id, mask=valid, other=-1)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        live = s * SPLIT <= end
        m_all = tl.maximum(m_all, tl.load(part_m + (i_bk * SPLITS + s) * ROWS + row_id, mask=live, other=float("-inf")))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        live = s * SPLIT <= end
        base = (i_bk * SPLITS + s) * ROWS + row_id
        w = tl.exp(tl.load(part_m + base, mask=live, other=float("-inf")) - m_safe)
        l_all += w * tl.load(part_l + base, mask=live, other=0.0)
        acc += w[:, None] * tl.load(part_o + base[:, None] * D + o_d[None, :], mask=live[:, None] & m_d[None, :], other=0.0)
    out = acc / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    p_o = o + i_b * s_ob + (i_kv * GROUP + g)[:, None] * s_oh + tok[:, None] * s_ot + o_d[None, :]
    tl.store(p_o, out.to(o.dtype.element_ty), mask=valid[:, None] & m_d[None, :])


@torch.library.custom_op("specgraph::attention_invariant", mutates_args=())
def attention_invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
    """Same signature and result as attention_reference; each query's bits independent of its step."""
    b, h, t, d = q.shape
    h_kv, width = k_cache.shape[1], mask.shape[1]
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1 or mask.stride(-1) != 1:
        raise ValueError("step attention needs the head dimension and the mask's slots contiguous")
    group = h // h_kv
    group_p2 = triton.next_power_of_2(group)
    tokens = max(1, 16 // group_p2)  # tokens per program: 16 rows at least, for the tensor cores
    rows, splits = t * group, triton.cdiv(width, SPLIT)
    part_o = torch.empty(b * h_kv * splits * rows, d, dtype=torch.float32, device=q.device)
    part_m = torch.empty(b * h_kv * splits * rows, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    ends = torch.empty(rows, dtype=torch.int32, device=q.device)
    out = token_major_like(q)
    blocks = triton.cdiv(t, tokens)
    common = dict(GROUP=group, GROUP_P2=group_p2, TOKENS=tokens, SPLIT=SPLIT, D=d,
                  BLOCK_D=max(16, triton.next_power_of_2(d)), **launch(q.device))
    _partials[(b * h_kv, blocks, splits)](
        q, k_cache, v_cache, mask.view(torch.uint8), slots, part_o, part_m, part_l, ends, t, h_kv, width, rows, splits,
        1.0 / math.sqrt(d), q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), mask.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_C=BLOCK_C, **common)
    _merge[(b * h_kv, blocks)](part_o, part_m, part_l, ends, out, t, rows, splits, out.stride(0), out.stride(1),
                               out.stride(2), h_kv, **common)
    return out


@attention_invariant.register_fake
def _(q, k_cache, v_cache, mask, slots):
    return token_major_like(q)
