"""A stage: one model and its cache on its device — the unit that executors schedule.

A stage's cache holds a prefix of the committed tokens. `catch_up` feeds whatever committed
tokens it lacks; `forward` runs new tokens (draft-tree nodes, or a tree to verify) past the
prefix without committing them; `cache.commit` keeps the accepted ones.
"""

from __future__ import annotations

import torch
from torch import nn

from specgraph.cache import KVCache
from specgraph.tree import prefix_tree_mask


class Stage:
    def __init__(self, name: str, model: nn.Module, capacity: int, device: torch.device):
        self.name = name
        self.model = model
        self.device = device
        self.cache: KVCache = model.new_cache(capacity)

    @property
    def committed(self) -> int:
        return self.cache.length

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int,
                mask: torch.Tensor | None) -> torch.Tensor:
        """tokens, positions [T] at slots [slot, slot + T); mask [T, slot + T] or None -> logits [T, V]."""
        if slot + tokens.numel() > self.cache.capacity:
            raise RuntimeError(f"stage {self.name}: {slot + tokens.numel()} slots exceed the cache's "
                               f"{self.cache.capacity}; plan_memory sized it too small")
        return self.model(tokens[None], positions[None], self.cache, slot, mask)[0]

    @torch.inference_mode()
    def catch_up(self, committed: torch.Tensor) -> torch.Tensor | None:
        """Feed committed[length:] [T] and commit it; logits [V] of the last token, None if none was fed."""
        start, end = self.cache.length, committed.numel()
        if end == start:
            return None
        t = end - start
        positions = torch.arange(start, end, device=self.device)
        chain = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()  # each sees its predecessors
        mask = None if t == 1 else prefix_tree_mask(start, chain)
        logits = self.forward(committed[start:], positions, start, mask)
        self.cache.length = end
        return logits[-1]

