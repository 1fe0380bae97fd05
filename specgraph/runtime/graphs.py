"""CUDA graphs: a function recorded once per key and replayed from static input buffers."""

from __future__ import annotations

from typing import Callable, Hashable

import torch


class CapturedGraph:
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


class Replays:
    """Functions run through CUDA graphs, one per key, recorded on use number `after` of the key (that
    call runs it for real; earlier ones run it as it is: a key met once, such as a batch size the end
    of a run passes through, costs no capture), or run as they are where `captured` is False (a CPU,
    a step that draws)."""

    def __init__(self, captured: bool, pool=None, after: int = 1):
        self.captured, self.pool, self.after = captured, pool, after
        self.graphs: dict[Hashable, CapturedGraph] = {}
        self._uses: dict[Hashable, int] = {}

    def ready(self, key: Hashable) -> bool:
        """Whether a run of `key` now costs what its later runs will: replayed from its graph, or never captured."""
        return not self.captured or key in self.graphs

    def run(self, key: Hashable, fn: Callable, *inputs: torch.Tensor):
        """fn(*inputs), replayed from the graph of `key` (outputs static: the next replay overwrites them)."""
        if not self.captured or torch.cuda.is_current_stream_capturing():  # (a captured step records fn itself)
            return fn(*inputs)
        if key not in self.graphs and self._uses.setdefault(key, 0) + 1 < self.after:
            self._uses[key] += 1
            return fn(*inputs)
        if key not in self.graphs:
            self.graphs[key], first = CapturedGraph.record(fn, inputs, self.pool)
            return first
        return self.graphs[key](*inputs)
