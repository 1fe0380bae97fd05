"""Timing the engine's own steps before any request runs: the step costs a policy weighs
(policy.py) and the batch-wide budget's table (budget.py).

A step of c requests is timed on the runner's first c request slots, which borrow blocks of the
pool and claim `context` committed tokens each (the K/V they read is garbage: a step's cost does
not depend on it), lowered as the engine runs it (a CUDA graph per mode, size and budget where
steps are captured: those graphs are the ones the engine then replays). Every slot is given back
as it was: call this before any request is admitted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import contextmanager

import torch

from specgraph.engine.runner import Mode, Runner
from specgraph.tree import CATCH_UP

log = logging.getLogger("specgraph.build")  # (cli.py shows it where someone watches)
WARMUP, TIMINGS = 1, 3  # untimed steps (the first captures), then timed ones: the fastest counts
Agree = Callable[[tuple[float, ...]], tuple[float, ...]]  # measured times -> the times every rank takes


def same(seconds: tuple[float, ...]) -> tuple[float, ...]:
    """A process alone: its own times."""
    return seconds


@contextmanager
def borrowed(runner: Runner, size: int, context: int):
    """Table rows 0 .. size - 1 of every stage with blocks of the pool and `context` committed
    tokens, decodable -> those rows [size]; all put back after."""
    device = runner.device
    rows = torch.arange(size, device=device)
    saved = [stage.table.clone() for stage in runner.stages]
    for stage in runner.stages:
        blocks = stage.table.shape[1]
        stage.table[:size] = 1 + torch.arange(size * blocks, device=device).view(size, blocks) % (stage.cache.blocks - 1)
    runner.ends[:size] = runner.tokens.shape[1]
    try:
        yield rows
    finally:
        for stage, table in zip(runner.stages, saved):
            stage.table.copy_(table)
        runner.lengths[:size] = CATCH_UP
        runner.ends[:size] = 0


def step_seconds(runner: Runner, mode: Mode, size: int, budget: int | None, context: int,
                 agree: Agree = same) -> tuple[float, float]:
    """(draft, verify) seconds of a step of `size` requests at `context` committed tokens in `mode`
    (with `budget` nodes where given), by the runner's clock: the fastest of TIMINGS steps, as
    `agree` makes it (the slowest rank's, where several run the step)."""
    best = None
    with borrowed(runner, size, context) as rows, torch.inference_mode():
        for attempt in range(WARMUP + TIMINGS):
            runner.lengths[:size] = context
            clock = runner.clock(runner.device)
            runner.step(rows, mode, context + mode.depth + 1, budget, clock)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            seconds = tuple(clock.seconds())
            if attempt >= WARMUP and (best is None or sum(seconds) < sum(best)):
                best = seconds
    return agree(best)


def step_costs(runner: Runner, modes: list[Mode], sizes: list[int], budget, context: int,
               agree: Agree = same) -> dict[str, dict[int, float]]:
    """Seconds of a step of each mode at each batch size (`budget`: nodes by batch size for
    speculative modes, None: each request its tree's)."""
    def nodes(mode: Mode, c: int) -> int | None:
        return None if budget is None or mode.drafter is None else budget(c, mode.nodes)

    costs = {}
    for mode in modes:
        costs[mode.name] = {c: sum(step_seconds(runner, mode, c, nodes(mode, c), context, agree)) for c in sizes}
        log.info("a step of %s: %s ms at batch sizes %s", mode.name,
                 ", ".join(f"{1e3 * s:.2f}" for s in costs[mode.name].values()), sizes)
    return costs


def budget_table(runner: Runner, mode: Mode, sizes: list[int], epsilon: float, context: int,
                 agree: Agree = same) -> dict[int, int]:
    """B(c) for each batch size c of `sizes`: the most nodes (c times a whole number of nodes per
    request, up to `mode`'s tree) whose verification takes at most (1 + epsilon) times that of a
    plain step of c requests (its time grows with the nodes: a bisection)."""
    table = {}
    for c in sizes:
        bound = (1 + epsilon) * step_seconds(runner, runner.modes[0], c, None, context, agree)[1]
        low, high = 0, mode.nodes  # low fits (none always does: it is a plain step's forward)
        while low < high:
            middle = (low + high + 1) // 2
            if step_seconds(runner, mode, c, c * middle, context, agree)[1] <= bound:
                low = middle
            else:
                high = middle - 1
        table[c] = c * low
        log.info("batch size %d verifies at most %d nodes", c, c * low)
    return table

