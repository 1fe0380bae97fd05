"""Triton greedy acceptance: one program holds the whole tree (N + 1 <= BLOCK nodes) in registers:
match flags, the on-path test over the ancestor matrix, the deepest path node, the path and the
bonus, in one launch instead of a dozen small kernels."""

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
