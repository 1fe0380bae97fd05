"""A stage: one model and its cache on its device — the unit that executors schedule.

A stage's cache holds a prefix of the committed tokens. `catch_up` feeds whatever committed
tokens it lacks; `forward` runs new tokens (draft-tree nodes, or a tree to verify) past the
prefix without committing them; `cache.commit` keeps the accepted ones.

Every forward of T tokens can have the same shapes (the model attends over the whole cache under a
mask), so on a GPU the stage captures one CUDA graph for each T in its `graph_buckets` (planned by
the capture_graphs pass) on first use and replays it afterwards: a step then costs one graph
launch instead of hundreds of kernel launches. Other sizes (prefill) run eagerly over the used slots.
"""

from __future__ import annotations

import torch
from torch import nn

from specgraph.cache import KVCache
from specgraph.tree import prefix_tree_mask


class CapturedForward:
    """One CUDA graph of `model` for T tokens, replayed from static input buffers."""

    def __init__(self, model: nn.Module, cache: KVCache, inputs: list[torch.Tensor], pool):
        self.inputs = inputs  # static: tokens [1, T], positions [1, T], slots [T], mask [T, S]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):  # recorded, not run
            self.output = model(*inputs[:2], cache, *inputs[2:])

    @classmethod
    def capture(cls, model: nn.Module, cache: KVCache, tokens, positions, slots, mask,
                pool) -> tuple[CapturedForward, torch.Tensor]:
        """Run this call's forward once (the warm-up capture needs), then record it; returns the
        graph and that run's logits."""
        inputs = [x.clone() for x in (tokens, positions, slots, mask)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            first = model(*inputs[:2], cache, *inputs[2:])
        torch.cuda.current_stream().wait_stream(stream)
        return cls(model, cache, inputs, pool), first

    def __call__(self, tokens, positions, slots, mask) -> torch.Tensor:
        for buffer, value in zip(self.inputs, (tokens, positions, slots, mask)):
            buffer.copy_(value)
        self.graph.replay()
        return self.output.clone()  # the next replay overwrites the static output


class Stage:
    def __init__(self, name: str, model: nn.Module, capacity: int, device: torch.device,
                 graph_buckets: tuple[int, ...] = ()):
        self.name = name
        self.model = model
        self.device = device
        self.cache: KVCache = model.new_cache(capacity)
        self.graph_buckets = frozenset(graph_buckets)
        self._graphs: dict[int, CapturedForward] = {}
        self._pool = torch.cuda.graph_pool_handle() if graph_buckets else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int,
                mask: torch.Tensor | None) -> torch.Tensor:
        """tokens, positions [T] at slots [slot, slot + T); mask [T, slot + T] (None: all visible) -> logits [T, V]."""
        t, end = tokens.numel(), slot + tokens.numel()
        if end > self.cache.capacity:
            raise RuntimeError(f"stage {self.name}: {end} slots exceed the cache's {self.cache.capacity}; "
                               "plan_memory sized it too small")
        slots = torch.arange(slot, end, device=self.device)
        if mask is None:
            mask = torch.ones(t, end, dtype=torch.bool, device=self.device)
        if t not in self.graph_buckets:  # eager: attend over the used slots only
            return self.model(tokens[None], positions[None], self.cache, slots, mask)[0]
        full = torch.zeros(t, self.cache.capacity, dtype=torch.bool, device=self.device)  # [T, S]: static shape
        full[:, :end] = mask
        args = (tokens[None], positions[None], slots, full)
        if t not in self._graphs:
            self._graphs[t], first = CapturedForward.capture(self.model, self.cache, *args, self._pool)
            return first[0].clone()
        return self._graphs[t](*args)[0]

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
