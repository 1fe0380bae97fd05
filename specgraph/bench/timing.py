"""Timing of one call as the kernel micro-benchmarks (scripts/bench_*.py) take it: the mean over
CUDA-graph replays; its peak memory. (The best of a few calls on any device: runtime/clock.py.)"""

from __future__ import annotations

from typing import Callable

import torch


def graph_time_us(fn: Callable[[], object], replays: int = 200) -> float:
    """Mean microseconds per call of fn (captured as a CUDA graph of 10 calls, replayed)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays // 10):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def peak_bytes(fn: Callable[[], object]) -> int:
    """Bytes fn allocates beyond what is allocated when it starts, at its peak (its outputs included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak
