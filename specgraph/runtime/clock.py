"""Marks in time: a step's phase boundaries, the bench's copies; the best time of a call."""

from __future__ import annotations

import time
from typing import Callable

import torch


class Clock:
    """CUDA events on a GPU (read after the step's one host read, so timing adds no wait), host
    time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    @staticmethod
    def now() -> float:
        """The host's time in seconds (what the engine charges a step: one collection to the next)."""
        return time.perf_counter()

    def mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds between consecutive marks."""
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


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
