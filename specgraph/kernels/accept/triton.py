"""Triton acceptance over a batch of R trees, one program per tree (grid (R,)): the trees share
nothing but the launch. Inputs may be views whose rows share storage (a static tree's structure
expanded over the batch, row stride 0): the kernels take each input's row stride, and the
wrappers copy only an input whose rows are not themselves contiguous.

Greedy: a whole tree (N + 1 <= BLOCK nodes) in registers: match flags, the on-path test over the
ancestor matrix, the deepest path node, the path and the bonus, in one launch instead of a dozen
small kernels.

Sampling: the walk down each tree runs as device control flow, so only the tries that happen cost
anything (the tensor-op reference runs every depth x rank try of every tree): an acceptance test
reads two probabilities (one where the proposals are one-hot: `proposals` None, read from no
tensor), a rejection is one pass over the vocabulary writing the residual into one of the tree's
two scratch rows (not the one p may be in: a residual that comes out zero leaves p as it was, as in
the reference), and the bonus is drawn by inverse CDF in two passes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_greedy(tokens, parents, ancestors, depths, best, path, bonus, N, D, s_t, s_p, s_a, s_d, s_b,
                   BLOCK: tl.constexpr):
    """One program per tree: tokens, parents, depths, best [N] and ancestors [N, N] (N: the node
    slots, the references' N + 1) at their row strides s_*; path [D + 1] and bonus [] of row r of
    contiguous outputs."""
    i_r = tl.program_id(0)
    p_anc = ancestors + i_r * s_a  # [N, N]
    p_dep = depths + i_r * s_d
    p_best = best + i_r * s_b
    o_i = tl.arange(0, BLOCK)  # nodes (rows of the ancestor matrix, then depths of the path)
    o_j = tl.arange(0, BLOCK)  # nodes (columns)
    m_i, m_j = o_i < N, o_j < N
    b_par = tl.load(parents + i_r * s_p + o_i, mask=m_i, other=0)
    b_match = (tl.load(tokens + i_r * s_t + o_i, mask=m_i, other=-1)
               == tl.load(p_best + tl.maximum(b_par, 0), mask=m_i, other=-2)) | (b_par < 0)  # [BLOCK]: the root always
    b_anc = tl.load(p_anc + o_i[:, None] * N + o_j[None, :], mask=m_i[:, None] & m_j[None, :], other=0) != 0
    broken = tl.max((b_anc & ~b_match[None, :]).to(tl.int32), axis=1)  # [BLOCK]: some ancestor mismatched
    score = tl.where(m_i & (broken == 0), tl.load(p_dep + o_i, mask=m_i, other=0), -1)
    last = tl.argmax(score, axis=0)  # the deepest path node (the first of equals, like torch.argmax)
    b_row = tl.load(p_anc + last * N + o_j, mask=m_j, other=0) != 0  # [BLOCK]: the path to `last`
    b_dep = tl.load(p_dep + o_j, mask=m_j, other=-1)
    hit = b_row[None, :] & (b_dep[None, :] == o_i[:, None])  # [depth, node]
    node = tl.sum(tl.where(hit, o_j[None, :], 0), axis=1)
    found = tl.max(hit.to(tl.int32), axis=1)
    tl.store(path + i_r * (D + 1) + o_i, tl.where(found != 0, node, -1), mask=o_i <= D)
    tl.store(bonus + i_r, tl.load(p_best + last))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, ...] with each row contiguous; rows may share storage (an expanded view stays a view)."""
    return x if x[:1].is_contiguous() else x.contiguous()  # (a size-1 dim's stride does not count)


@torch.library.custom_op("specgraph::accept_greedy", mutates_args=())
def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor,
                  best: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as accept_greedy_reference (N + 1 <= 128 node slots)."""
    r, n = tokens.shape
    if n > 128:
        raise ValueError(f"accept_greedy holds at most 128 tree nodes; got {n}")
    tokens, parents, ancestors, depths, best = (_rows(x) for x in (tokens, parents, ancestors, depths, best))
    path = torch.empty(r, max_depth + 1, dtype=torch.long, device=tokens.device)
    bonus = torch.empty(r, dtype=torch.long, device=tokens.device)
    _accept_greedy[(r,)](tokens, parents, ancestors.view(torch.uint8), depths, best, path, bonus, n, max_depth,
                         tokens.stride(0), parents.stride(0), ancestors.stride(0), depths.stride(0), best.stride(0),
                         BLOCK=max(16, triton.next_power_of_2(max(n, max_depth + 1))))
    return path, bonus


@accept_greedy.register_fake
def _(tokens, parents, ancestors, depths, best, max_depth):
    r = tokens.shape[0]
    return tokens.new_empty(r, max_depth + 1, dtype=torch.long), tokens.new_empty(r, dtype=torch.long)


@triton.jit
def _accept_sampling(tokens, child_table, probs, proposals, uniforms, residual, path, bonus, V, C, D,
                     s_t, s_c, s_p, s_q, s_u, ONE_HOT: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per tree: tokens [N], child_table [N, C], probs and proposals [N, V] (ONE_HOT:
    proposals unread, each node's law the one-hot of its token) and uniforms [D * C + 1] at their
    row strides s_*; residual [2, V] scratch, path [D + 1] and bonus [] of row r of contiguous buffers."""
    i_r = tl.program_id(0).to(tl.int64)  # (R * N * V may pass 2^31)
    p_tok = tokens + i_r * s_t
    p_kids = child_table + i_r * s_c
    p_probs = probs + i_r * s_p
    p_q = proposals + i_r * s_q
    p_u = uniforms + i_r * s_u
    p_res = residual + i_r * 2 * V
    p_path = path + i_r * (D + 1)
    o_d = tl.arange(0, BLOCK_D)
    tl.store(p_path + o_d, tl.where(o_d == 0, 0, -1), mask=o_d <= D)  # [0, -1, ..., -1]
    node = tl.full([], 0, tl.int64)
    stopped = tl.full([], 0, tl.int32)
    src = p_probs  # p = src / z: the node's probs row, then a residual
    z = tl.full([], 1.0, tl.float32)
    spare = tl.full([], 0, tl.int32)  # the scratch row p is not in
    for depth in range(D):
        if stopped == 0:
            src = p_probs + node * V
            z = tl.full([], 1.0, tl.float32)
            chosen = tl.full([], -1, tl.int64)
            for rank in range(C):
                child = tl.load(p_kids + node * C + rank)
                if (child >= 0) & (chosen < 0):
                    x = tl.maximum(tl.load(p_tok + child), 0)  # (a padding node's -1 reads column 0, as the reference)
                    at_token = tl.load(src + x) / z
                    if ONE_HOT:
                        ratio = at_token
                    else:
                        ratio = tl.minimum(at_token / tl.load(p_q + child * V + x), 1.0)
                    if tl.load(p_u + depth * C + rank) < ratio:
                        chosen = child
                    else:  # p becomes the normalised residual: max(0, p - r), for a one-hot r p without x
                        p_dst = p_res + spare * V
                        total = tl.full([], 0.0, tl.float32)
                        for v0 in range(0, V, BLOCK_V):
                            o_v = v0 + tl.arange(0, BLOCK_V)
                            m_v = o_v < V
                            b_p = tl.load(src + o_v, mask=m_v, other=0.0) / z
                            if ONE_HOT:
                                b_r = tl.where(o_v == x, 0.0, b_p)
                            else:
                                b_r = tl.maximum(b_p - tl.load(p_q + child * V + o_v, mask=m_v, other=0.0), 0.0)
                            tl.store(p_dst + o_v, b_r, mask=m_v)
                            total += tl.sum(b_r, axis=0)
                        tl.debug_barrier()  # the residual's stores precede every thread's reads
                        # A zero residual (p <= r: the ratio was 1 up to rounding) leaves p as it was,
                        # which is why it went to the other scratch row.
                        if total > 0:
                            src = p_dst
                            z = tl.maximum(total, 1e-30)
                            spare = 1 - spare
            if chosen >= 0:
                tl.store(p_path + depth + 1, chosen)
                node = chosen
            else:
                stopped = 1
    if stopped == 0:  # reached the deepest level: the bonus follows the last node's distribution
        src = p_probs + node * V
    _draw(src, p_u + D * C, bonus + i_r, V, BLOCK_V)


@triton.jit
def _draw(src, u, bonus, V, BLOCK_V: tl.constexpr):
    """Store the token of src [V] (unnormalised) at uniform *u: the first whose running sum passes
    u * sum (inverse CDF), or the last of positive probability if rounding passes none."""
    total = tl.full([], 0.0, tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        total += tl.sum(tl.load(src + cols, mask=cols < V, other=0.0), axis=0)
    target = tl.load(u) * total
    running = tl.full([], 0.0, tl.float32)
    found = tl.full([], 0, tl.int32) + V
    last = tl.full([], -1, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        m = cols < V
        p = tl.load(src + cols, mask=m, other=0.0)
        passed = m & (running + tl.cumsum(p, axis=0) > target)
        found = tl.minimum(found, tl.min(tl.where(passed, cols, V), axis=0))
        last = tl.maximum(last, tl.max(tl.where(m & (p > 0), cols, -1), axis=0))
        running += tl.sum(p, axis=0)
    tl.store(bonus, tl.where(found < V, found, last))


@torch.library.custom_op("specgraph::accept_sampling", mutates_args=())
def accept_sampling(tokens: torch.Tensor, child_table: torch.Tensor, probs: torch.Tensor,
                    proposals: torch.Tensor | None, uniforms: torch.Tensor,
                    max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as accept_sampling_reference (up to the order of fp32 sums)."""
    if probs.dtype != torch.float32 or (proposals is not None and proposals.dtype != torch.float32):
        raise ValueError("accept_sampling needs fp32 probs and proposals")
    r, _, c = child_table.shape
    v = probs.shape[2]
    tokens, child_table, probs, uniforms = (_rows(x) for x in (tokens, child_table, probs, uniforms))
    one_hot = proposals is None
    proposals = probs if one_hot else _rows(proposals)  # (one-hot: a pointer the kernel never reads)
    residual = torch.empty(r, 2, v, dtype=torch.float32, device=probs.device)  # p's rows after rejections
    path = torch.empty(r, max_depth + 1, dtype=torch.long, device=probs.device)
    bonus = torch.empty(r, dtype=torch.long, device=probs.device)
    _accept_sampling[(r,)](tokens, child_table, probs, proposals, uniforms, residual, path, bonus, v, c, max_depth,
                           tokens.stride(0), child_table.stride(0), probs.stride(0), proposals.stride(0),
                           uniforms.stride(0), ONE_HOT=one_hot, BLOCK_V=min(4096, triton.next_power_of_2(v)),
                           BLOCK_D=triton.next_power_of_2(max_depth + 1), num_warps=8)
    return path, bonus


@accept_sampling.register_fake
def _(tokens, child_table, probs, proposals, uniforms, max_depth):
    r = tokens.shape[0]
    return tokens.new_empty(r, max_depth + 1, dtype=torch.long), tokens.new_empty(r, dtype=torch.long)
