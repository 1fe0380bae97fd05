"""Reference acceptance over a batch of R trees, fixed sequences of tensor operations (no host reads).

Every tree has N + 1 node slots; a tree with fewer nodes pads the rest as children of its root
carrying token -1, which no target token matches (verification sets that up)."""

from __future__ import annotations

import torch


def accept_greedy_reference(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor,
                            best: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, parents, depths, best (the target's argmax at each node) [R, N + 1]; ancestors [R, N +
    1, N + 1] bool (i itself included). Siblings carry distinct tokens, so at most one child matches.
    Returns the accepted paths [R, D + 1] (node indices by depth, -1 after the last) and the bonuses [R]."""
    r, n = tokens.shape
    matches = (tokens == best.gather(1, parents.clamp(min=0))) | (parents < 0)  # [R, N + 1]: the root always
    on_path = ~(ancestors & ~matches[:, None, :]).any(-1)  # node and all its ancestors matched
    last = torch.where(on_path, depths, -1).argmax(1)  # [R]
    row = ancestors[torch.arange(r, device=tokens.device), last]  # [R, N + 1]: the path to `last`
    slots = torch.where(row, depths, max_depth + 1)  # non-ancestors go to a spare slot
    path = torch.full((r, max_depth + 2), -1, dtype=torch.long, device=tokens.device)
    path.scatter_(1, slots, torch.arange(n, device=tokens.device).expand(r, -1))
    return path[:, : max_depth + 1], best.gather(1, last[:, None])[:, 0]


def rows_at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[r, i[r]] for every row r: x [R, M, ...], i [R] -> [R, ...] (a gather, no host read)."""
    index = i.reshape(-1, 1, *([1] * (x.dim() - 2))).expand(-1, 1, *x.shape[2:])
    return x.gather(1, index)[:, 0]


def walk_tree(child_table: torch.Tensor, probs: torch.Tensor, max_depth: int,
              try_child) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk each tree down from its root, at each node offering its children (child_table [R, N +
    1, C], in rank order, -1 past the last) to `try_child(p, node, child, depth, rank) -> (accept
    [R] bool, p after a rejection [R, V])`, p starting as the node's probs [R, V]. Returns the paths
    [R, D + 1] and the distributions p [R, V] left where the walks stopped (the bonuses' laws)."""
    r, device = probs.shape[0], probs.device
    path = torch.full((r, max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, 0].fill_(0)  # (fill_: no host value copied in)
    node = torch.zeros(r, dtype=torch.long, device=device)
    stopped = torch.zeros(r, dtype=torch.bool, device=device)
    final = probs[:, 0]
    for depth in range(max_depth):
        p = rows_at(probs, node)
        chosen = torch.full((r,), -1, dtype=torch.long, device=device)
        for rank in range(child_table.shape[2]):
            child = rows_at(child_table[:, :, rank], node)  # [R]
            live = (child >= 0) & ~stopped & (chosen < 0)
            accept, rejected_p = try_child(p, node, child.clamp(min=0), depth, rank)
            chosen = torch.where(live & accept, child, chosen)
            p = torch.where((live & ~accept)[:, None], rejected_p, p)
        moved = chosen >= 0
        final = torch.where((~stopped & ~moved)[:, None], p, final)  # where the walk stops, p is the bonus's law
        path[:, depth + 1] = torch.where(moved, chosen, -1)
        stopped = stopped | ~moved
        node = torch.where(moved, chosen, node)
    final = torch.where(stopped[:, None], final, rows_at(probs, node))  # reached a leaf at the deepest level
    return path, final


def draw(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The tokens [R] of p [R, V] (not necessarily normalised) at uniforms u [R] in [0, 1): the
    first whose running sum passes u * sum (inverse CDF), or the last of positive probability if
    rounding passes none."""
    cdf = p.cumsum(1)
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    last = torch.where(p > 0, torch.arange(p.shape[1], device=p.device), -1).max(1).values
    return torch.where(index < p.shape[1], index, last)

