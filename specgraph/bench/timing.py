"""Timing of one call: the best of a few on any device (`specgraph tune`'s forwards), or the mean
over CUDA-graph replays (the kernel micro-benchmarks, scripts/bench_*.py); its peak memory."""

from __future__ import annotations

from typing import Callable

import torch

from specgraph.runtime.clock import Clock


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


def best_seconds(call: Callable[[], object], device: torch.device, calls: int = 1, warmup: int = 1,
                 timings: int = 5) -> float:
    """Seconds per call of `call`: the best of `timings` timings of `calls` back-to-back calls after
    `warmup` untimed ones, each timed by a `Clock` (on a GPU by CUDA events, so no launch or host
    synchronisation around the calls is counted)."""
    for _ in range(warmup):
        call()
    best = float("inf")
    for _ in range(timings):
        clock = Clock(device)
        clock.mark()
        for _ in range(calls):
            call()
        clock.mark()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, clock.seconds()[0])
    return best / calls
