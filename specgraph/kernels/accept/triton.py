"""Triton greedy acceptance over a batch of R trees, one program per tree (grid (R,)): the trees
share nothing but the launch. Inputs may be views whose rows share storage (a static tree's
structure expanded over the batch, row stride 0): the kernel takes each input's row stride, and
the wrapper copies only an input whose rows are not themselves contiguous.

A whole tree (N + 1 <= BLOCK nodes) in registers: match flags, the on-path test over the ancestor
matrix, the deepest path node, the path and the bonus, in one launch instead of a dozen small
kernels."""

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

