"""Triton acceptance, one program each.

Greedy: the whole tree (N + 1 <= BLOCK nodes) in registers: match flags, the on-path test over the
ancestor matrix, the deepest path node, the path and the bonus, in one launch instead of a dozen
small kernels.

Sampling: the walk down the tree runs as device control flow, so only the tries that happen cost
anything (the tensor-op reference runs every depth x rank try): an acceptance test reads two
probabilities, a rejection is one pass over the vocabulary writing the residual, and the bonus is
drawn by inverse CDF in two passes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_greedy(tokens, parents, ancestors, depths, best, path, bonus, N, D, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < N
    parent = tl.load(parents + i, mask=m, other=0)
    match = (tl.load(tokens + i, mask=m, other=-1) == tl.load(best + tl.maximum(parent, 0), mask=m, other=-2)) | (parent < 0)
    j = tl.arange(0, BLOCK)
    anc = tl.load(ancestors + i[:, None] * N + j[None, :], mask=m[:, None] & (j < N)[None, :], other=0) != 0
    broken = tl.max((anc & ~match[None, :]).to(tl.int32), axis=1)  # [BLOCK]: some ancestor mismatched
    depth = tl.load(depths + i, mask=m, other=0)
    score = tl.where(m & (broken == 0), depth, -1)
    last = tl.argmax(score, axis=0)
    row = tl.load(ancestors + last * N + j, mask=j < N, other=0) != 0  # the path to `last`
    depth_j = tl.load(depths + j, mask=j < N, other=-1)
    d = tl.arange(0, BLOCK)
    hit = row[None, :] & (depth_j[None, :] == d[:, None])  # [depth, node]
    node = tl.sum(tl.where(hit, j[None, :], 0), axis=1)
    found = tl.max(hit.to(tl.int32), axis=1)
    tl.store(path + d, tl.where(found != 0, node, -1), mask=d <= D)
    tl.store(bonus, tl.load(best + last))


@torch.library.custom_op("specgraph::accept_greedy", mutates_args=())
def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor,
                  best: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as accept_greedy_reference (N + 1 <= 128 nodes)."""
    n = tokens.numel()
    if n > 128:
        raise ValueError(f"accept_greedy holds at most 128 tree nodes; got {n}")
    path = torch.empty(max_depth + 1, dtype=torch.long, device=tokens.device)
    bonus = torch.empty((), dtype=torch.long, device=tokens.device)
    block = max(16, triton.next_power_of_2(max(n, max_depth + 1)))
    _accept_greedy[(1,)](tokens, parents, ancestors.contiguous().view(torch.uint8), depths, best, path, bonus,
                         n, max_depth, BLOCK=block)
    return path, bonus


@accept_greedy.register_fake
def _(tokens, parents, ancestors, depths, best, max_depth):
    return tokens.new_empty(max_depth + 1), tokens.new_empty(())


@triton.jit
def _accept_sampling(tokens, child_table, probs, proposals, uniforms, residual, path, bonus, V, C, D,
                     s_p, s_q, s_c, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    o_d = tl.arange(0, BLOCK_D)
    tl.store(path + o_d, tl.where(o_d == 0, 0, -1), mask=o_d <= D)  # [0, -1, ..., -1]
    node = tl.full([], 0, tl.int64)
    stopped = tl.full([], 0, tl.int32)
    src = probs  # p = src / z: the root's row, then a residual
    z = tl.full([], 1.0, tl.float32)
    for depth in range(0, D):
        if stopped == 0:
            src = probs + node * s_p
            z = tl.full([], 1.0, tl.float32)
            chosen = tl.full([], -1, tl.int64)
            for rank in range(0, C):
                child = tl.load(child_table + node * s_c + rank)
                if (child >= 0) & (chosen < 0):
                    x = tl.load(tokens + child)
                    q_row = proposals + child * s_q
                    ratio = tl.minimum(tl.load(src + x) / z / tl.load(q_row + x), 1.0)
                    if tl.load(uniforms + depth * C + rank) < ratio:
                        chosen = child
                    else:  # p becomes the normalised residual max(0, p - q)
                        total = tl.full([], 0.0, tl.float32)
                        for v0 in range(0, V, BLOCK_V):
                            cols = v0 + tl.arange(0, BLOCK_V)
                            m = cols < V
                            r = tl.maximum(tl.load(src + cols, mask=m, other=0.0) / z
                                           - tl.load(q_row + cols, mask=m, other=0.0), 0.0)
                            tl.store(residual + cols, r, mask=m)  # (in place when src is the residual)
                            total += tl.sum(r, axis=0)
                        tl.debug_barrier()  # the residual's stores precede every thread's reads
                        src = residual
                        # total is 0 only when p equals q, where the ratio was 1 and nothing is rejected
                        z = tl.maximum(total, 1e-30)
            if chosen >= 0:
                tl.store(path + depth + 1, chosen)
                node = chosen
            else:
                stopped = 1
    if stopped == 0:  # reached the deepest level: the bonus follows the last node's distribution
        src = probs + node * s_p
    _draw(src, uniforms + D * C, bonus, V, BLOCK_V)


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
def accept_sampling(tokens: torch.Tensor, child_table: torch.Tensor, probs: torch.Tensor, proposals: torch.Tensor,
                    uniforms: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as accept_sampling_reference (up to the order of fp32 sums)."""
    if probs.dtype != torch.float32 or proposals.dtype != torch.float32:
        raise ValueError("accept_sampling needs fp32 probs and proposals")
    v = probs.shape[1]
    probs, proposals, child_table = probs.contiguous(), proposals.contiguous(), child_table.contiguous()
    residual = torch.empty(v, dtype=torch.float32, device=probs.device)
    path = torch.empty(max_depth + 1, dtype=torch.long, device=probs.device)
    bonus = torch.empty((), dtype=torch.long, device=probs.device)
    _accept_sampling[(1,)](tokens, child_table, probs, proposals, uniforms, residual, path, bonus, v,
                           child_table.shape[1], max_depth, probs.stride(0), proposals.stride(0), child_table.stride(0),
                           BLOCK_V=min(4096, triton.next_power_of_2(v)), BLOCK_D=triton.next_power_of_2(max_depth + 1),
                           num_warps=8)
    return path, bonus


@accept_sampling.register_fake
def _(tokens, child_table, probs, proposals, uniforms, max_depth):
    return tokens.new_empty(max_depth + 1), tokens.new_empty(())
