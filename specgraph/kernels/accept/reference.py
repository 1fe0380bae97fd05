"""Reference acceptance, fixed sequences of tensor operations (no host reads)."""

from __future__ import annotations

import torch


def accept_greedy_reference(tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor,
                            best: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, parents, depths, best (the target's argmax at each node) [N + 1]; ancestors [N + 1, N + 1]
    bool (i itself included). Siblings carry distinct tokens, so at most one child matches.
    Returns the accepted path [D + 1] (node indices by depth, -1 after the last) and the bonus []."""
    matches = (tokens == best[parents.clamp(min=0)]) | (parents < 0)  # [N + 1]: the root always
    on_path = ~(ancestors & ~matches[None, :]).any(-1)  # node and all its ancestors matched
    last = torch.where(on_path, depths, -1).argmax()
    row = ancestors.index_select(0, last.reshape(1))[0]  # [N + 1]: the path to `last`
    slots = torch.where(row, depths, max_depth + 1)  # non-ancestors go to a spare slot
    path = torch.full((max_depth + 2,), -1, dtype=torch.long, device=tokens.device)
    path.scatter_(0, slots, torch.arange(tokens.numel(), device=tokens.device))
    return path[: max_depth + 1], best.index_select(0, last.reshape(1))[0]


def at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[i] for a 0-dim index tensor, as a gather: indexing with it directly would read it on the host."""
    return x.index_select(0, i.reshape(1))[0]


def walk_tree(child_table: torch.Tensor, probs: torch.Tensor, max_depth: int,
              try_child) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk down from the root, at each node offering its children (child_table [N + 1, C], in rank
    order, -1 past the last) to `try_child(p, node, child, depth, rank) -> (accept [] bool, p after
    a rejection [V])`, p starting as the node's probs [V]. Returns the path [D + 1] and the
    distribution p [V] left where the walk stopped (the bonus token's law)."""
    device = probs.device
    path = -(torch.arange(max_depth + 1, device=device) > 0).long()  # [0, -1, ..., -1]
    node = torch.zeros((), dtype=torch.long, device=device)
    stopped = torch.zeros((), dtype=torch.bool, device=device)
    final = probs[0]
    for depth in range(max_depth):
        p = at(probs, node)
        chosen = torch.full((), -1, dtype=torch.long, device=device)
        for rank in range(child_table.shape[1]):
            child = at(child_table[:, rank], node)
            live = (child >= 0) & ~stopped & (chosen < 0)
            accept, rejected_p = try_child(p, node, child.clamp(min=0), depth, rank)
            chosen = torch.where(live & accept, child, chosen)
            p = torch.where(live & ~accept, rejected_p, p)
        moved = chosen >= 0
        final = torch.where(~stopped & ~moved, p, final)  # where the walk stops, p is the bonus's law
        path[depth + 1] = torch.where(moved, chosen, -1)
        stopped = stopped | ~moved
        node = torch.where(moved, chosen, node)
    final = torch.where(stopped, final, at(probs, node))  # reached a leaf at the deepest level
    return path, final


def draw(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token [] of p [V] (not necessarily normalised) at uniform u [] in [0, 1): the first whose
    running sum passes u * sum (inverse CDF), or the last of positive probability if rounding
    passes none."""
    cdf = p.cumsum(0)
    index = torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True)[0]
    last = torch.where(p > 0, torch.arange(p.numel(), device=p.device), -1).max()
    return torch.where(index < p.numel(), index, last)


def accept_sampling_reference(tokens: torch.Tensor, child_table: torch.Tensor, probs: torch.Tensor,
                              proposals: torch.Tensor, uniforms: torch.Tensor,
                              max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless multi-candidate speculative sampling. tokens [N + 1]; child_table [N + 1, C]; probs
    [N + 1, V] fp32: the target's distribution at each node; proposals [N + 1, V] fp32: the law each
    node's token was drawn from; uniforms [D * C + 1] in [0, 1): the try of rank r at depth d uses
    uniforms[d * C + r], the bonus the last. A node's children are tried in rank order: child c is
    accepted with probability min(1, p(x_c) / r_c(x_c)); a rejection replaces p by the normalised
    residual max(0, p - r_c). Returns the accepted path [D + 1] and the bonus [], drawn from p where
    the walk stopped."""
    width = child_table.shape[1]

    def try_child(p: torch.Tensor, node: torch.Tensor, child: torch.Tensor, depth: int, rank: int):
        token, proposal = at(tokens, child), at(proposals, child)  # [], [V]
        ratio = (at(p, token) / at(proposal, token)).clamp(max=1.0)
        residual = (p - proposal).clamp(min=0)
        total = residual.sum()
        # total is 0 only when p equals the proposal, where the ratio was 1 and nothing is rejected.
        return uniforms[depth * width + rank] < ratio, torch.where(total > 0, residual / total.clamp(min=1e-30), p)

    path, final = walk_tree(child_table, probs, max_depth, try_child)
    return path, draw(final, uniforms[-1])
