"""Test helpers: recipes over the fixture models, and Markov-chain 'models' with known distributions."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from specgraph.cache import KVCache
from specgraph.recipe import Recipe
from specgraph.runtime.stage import Stage


def two_stage(target: Path, draft: Path | None, tree: dict | None = None, dtype: str = "float32",
              **fields) -> Recipe:
    """A recipe of `target` verified over `draft` (or the target alone when draft is None), on the CPU."""
    models = {"target": {"path": str(target), "dtype": dtype}}
    stages = [{"name": "target", "model": "target", "devices": ["cpu"]}]
    if draft is not None:
        models["draft"] = {"path": str(draft), "dtype": dtype}
        stages = [{"name": "draft", "model": "draft", "devices": ["cpu"], "tree": tree},
                  {**stages[0], "verifies": "draft"}]
    return Recipe.from_dict({"name": "test", "models": models, "stages": stages, **fields})


class MarkovModel(nn.Module):
    """Next-token distribution depends only on the current token: logits = log(table[token])."""

    def __init__(self, table: torch.Tensor):  # [V, V], rows sum to 1
        super().__init__()
        self.register_buffer("log_table", table.log())

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        return KVCache(0, batch, 1, 1, capacity, torch.float32, "cpu")

    def forward(self, tokens, positions, cache, slot, mask):
        return self.log_table[tokens]  # [B, T, V]


@torch.no_grad()
def chain_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids [T] run causally from an empty cache -> logits [T, V]."""
    return Stage("test", model, ids.numel() + 8, torch.device("cpu")).prefill(ids)


class HostReads(TorchDispatchMode):
    """Records the ops that would make a GPU wait for the host (scalar reads, data-dependent shapes)
    or copy from the host (Python values turned into tensors), neither of which a CUDA graph can hold."""

    SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.SYNCING:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))
