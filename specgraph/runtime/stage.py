"""A stage: one model and its KV cache on its device — the unit that executors schedule.

Forwards place their tokens at cache slots and attend under a mask over the first `width` slots.
Slots and masks are built on the device from device tensors (the committed length lives there),
so no forward needs a host read. With `width` = the cache's capacity every forward of T tokens has
the same shapes: on a GPU the stage then replays one CUDA graph per T in its `graph_buckets`
(planned by the capture_graphs pass), unless the whole step around it is being captured.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from specgraph.cache import KVCache
from specgraph.kernels import Kernels


def step_mask(start: torch.Tensor, visible: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width] bool: row i sees every slot before `start` ([] long) and slot start + j where
    visible[i, j] ([T, R] bool: the region of R slots from `start` that this step writes)."""
    region = visible.shape[1]
    offset = torch.arange(width, device=visible.device) - start  # [width]: slot - start
    seen = visible.index_select(1, offset.clamp(0, region - 1))  # [T, width]
    return (offset < 0) | (seen & (offset < region))


class Graph:
    """`fn(*inputs)` recorded as one CUDA graph and replayed from static input buffers.
    Outputs are static: each replay overwrites them."""

    def __init__(self, fn: Callable, inputs: tuple[torch.Tensor, ...], pool):
        self.inputs = inputs
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):  # recorded, not run
            self.output = fn(*inputs)

    @classmethod
    def record(cls, fn: Callable, inputs: tuple[torch.Tensor, ...], pool):
        """Run `fn` once for real on copies of `inputs` (capture needs a warm-up run), then record
        it; returns the graph and that run's result."""
        inputs = tuple(x.clone() for x in inputs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            first = fn(*inputs)
        torch.cuda.current_stream().wait_stream(stream)
        return cls(fn, inputs, pool), first

    def __call__(self, *inputs: torch.Tensor):
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        self.graph.replay()
        return self.output


class Stage:
    def __init__(self, name: str, model: nn.Module, capacity: int, device: torch.device,
                 graph_buckets: tuple[int, ...] = (), static_shapes: bool = False, kernels: Kernels = Kernels(),
                 vocab: tuple[int, int] | None = None):
        """`kernels`: the stage's choice of kernels, which its cache runs too; `vocab`: (rows, width)
        where the model's logits are to be `width` wide with only the first `rows` ids proposable (a
        drafter whose vocabulary is padded unlike its target's: the validate pass), None as they come."""
        self.name = name
        self.model = model
        self.vocab = vocab
        self.device = device
        self.cache: KVCache = model.new_cache(capacity, kernels=kernels)
        self.graph_buckets = frozenset(graph_buckets)
        self.static_shapes = static_shapes or bool(graph_buckets)  # attend over the whole cache
        self._graphs: dict[int, Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def width(self, length: int, step_tokens: int) -> int:
        """Slots a step's forwards attend over, `length` tokens committed and `step_tokens` written past them."""
        return self.cache.capacity if self.static_shapes else min(self.cache.capacity, length + step_tokens)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """tokens, positions, slots [T]; mask [T, width] -> logits [T, V]. Writes K/V at `slots`."""
        t = tokens.numel()

        def run(tokens, positions, slots, mask):
            return self._aligned(self.model(tokens[None], positions[None], self.cache, slots, mask)[0])

        static = mask.shape[1] == self.cache.capacity and t in self.graph_buckets
        if not static or torch.cuda.is_current_stream_capturing():  # a captured step records the model itself
            return run(tokens, positions, slots, mask)
        if t not in self._graphs:
            self._graphs[t], first = Graph.record(run, (tokens, positions, slots, mask), self.pool)
            return first
        return self._graphs[t](tokens, positions, slots, mask).clone()  # the next replay overwrites it

    @property
    def logits_width(self) -> int:
        """Columns of the logits `forward` returns."""
        return self.model.served_vocab if self.vocab is None else self.vocab[1]

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [T, V] -> [T, width]: ids past `rows` at -inf (see __init__)."""
        if self.vocab is None or self.vocab == (logits.shape[-1],) * 2:
            return logits
        rows, width = self.vocab
        aligned = logits.new_full((logits.shape[0], width), float("-inf"))
        aligned[:, :rows] = logits[:, :rows]
        return aligned

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens [T] at slots [0, T) -> logits [T, V]: eager forwards of at most the cache's
        `max_step_tokens`, each kept, attending over the slots written so far."""
        logits = []
        for start in range(0, tokens.numel(), self.cache.max_step_tokens):
            chunk = tokens[start : start + self.cache.max_step_tokens]
            t = chunk.numel()
            slots = start + torch.arange(t, device=self.device)
            causal = torch.ones(t, t, dtype=torch.bool, device=self.device).tril()
            logits.append(self.forward(chunk, slots, slots, step_mask(start, causal, start + t)))
            self.cache.keep(t)
        return torch.cat(logits)
