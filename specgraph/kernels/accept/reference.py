"""Reference greedy acceptance, a fixed sequence of tensor operations (no host reads)."""

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
