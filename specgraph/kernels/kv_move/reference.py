"""Reference KV row move: a gather of every source row, then a scatter to the destinations."""

from __future__ import annotations

import torch


def kv_move_reference(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """cache [L, B, H, S, K]: rows src [D] -> rows dst [D] (long, distinct dst), in place."""
    cache.index_copy_(3, dst, cache.index_select(3, src))
