"""The engine's build before any request runs: every shape its steps and prompt forwards can meet
run until it is compiled and captured (`warm_up`, so that none is built while serving), and its
own steps timed: the step costs a policy weighs (policy.py), with what a prompt token costs the
drafter, and the batch-wide budget's table (budget.py).

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

from specgraph.engine.runner import CAPTURE_AFTER, PREFILL_BUCKET, Mode, Runner, prompt_bucket
from specgraph.tree import CATCH_UP

log = logging.getLogger("specgraph.build")  # (cli.py shows it where someone watches)
WARMUP, TIMINGS = 1, 3  # untimed steps (the first captures), then timed ones: the fastest counts
TIMING_BUDGET = 30.0  # seconds the timing of one mode may take at most (one that would take longer is not run)
Agree = Callable[[tuple[float, ...]], tuple[float, ...]]  # measured times -> the times every rank takes


def same(seconds: tuple[float, ...]) -> tuple[float, ...]:
    """A process alone: its own times."""
    return seconds


@contextmanager
def borrowed(runner: Runner, size: int, context: int):
    """Table rows 0 .. size - 1 of every stage with blocks of the pool and `context` committed
    tokens, decodable -> those rows [size] (past the request slots, the padding row: a step's rows
    may pass them where steps are captured, as the engine's do); all put back after."""
    device, real = runner.device, min(size, runner.padding)
    rows = torch.tensor([*range(real), *[runner.padding] * (size - real)], device=device)
    saved = [stage.table.clone() for stage in runner.stages]
    for stage in runner.stages:
        blocks = stage.table.shape[1]
        stage.table[:real] = 1 + torch.arange(real * blocks, device=device).view(real, blocks) % (stage.cache.blocks - 1)
    runner.ends[:real] = runner.tokens.shape[1]
    try:
        yield rows
    finally:
        for stage, table in zip(runner.stages, saved):
            stage.table.copy_(table)
        runner.lengths[:real] = CATCH_UP
        runner.ends[:real] = 0


def powers_of_two(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... up to the first at least `high`."""
    values = [low]
    while values[-1] < high:
        values.append(2 * values[-1])
    return values


def step_shapes(runner: Runner, most: int) -> list[int]:
    """The rows a step of 1 to `most` requests may run: each capture size where steps are captured;
    elsewhere 1 and 2 (a compiled forward keeps sizes from 2 up symbolic: Dynamo specialises 1)."""
    if runner.captured:
        return sorted({runner.step_rows(c) for c in range(1, most + 1)})
    return [1, 2][:most]


def prompt_shapes(runner: Runner, most: int, chunk: int) -> list[tuple[int, int]]:
    """(chunks, tokens) of a prompt forward for each shape that a step feeding at most `chunk` prompt
    tokens to at most `most` newcomers may run: where they are captured, one for each bucket it can
    reach (runner.prompt_bucket); elsewhere forwards of one and two chunks, of one token each and of
    several (what a compiled forward specialises on: a drafter fed one missed token a request)."""
    if not runner.captured:
        return [(1, 1), (1, 4), (2, 2), (2, 4)]
    share = min(chunk, *(stage.max_step_tokens for stage in runner.stages))  # (the engine's prefill share)
    shapes = []
    for rows in powers_of_two(1, min(most, chunk)):
        for bucket in powers_of_two(PREFILL_BUCKET, chunk):
            chunks = min(rows, most)
            tokens = min(bucket, chunks * share, chunk)
            if chunks <= tokens and prompt_bucket(chunks, tokens) == (rows, bucket):
                shapes.append((chunks, tokens))
    return shapes


def warm_up(runner: Runner, modes: list[Mode], steps: list[int], prompts: list[tuple[int, int]], budget,
            context: int, progress: Callable[[str], None] = lambda note: None) -> None:
    """Run each mode's step at each of `steps` rows (`budget`: nodes by batch size, as `step_costs`
    takes it) and each prompt forward of `prompts` ((chunks, tokens), every stage's) as often as it
    takes to be compiled and, where steps are captured, captured; `progress(note)` after each shape."""
    most = max(steps + [rows for rows, _ in prompts])
    with borrowed(runner, most, context) as rows, torch.inference_mode():
        for mode in modes:
            feeds = (False, True) if mode.drafter is None and runner.features is not None else (False,)
            for size in steps:
                nodes = None if budget is None or mode.drafter is None else budget(size, mode.nodes)
                for feed in feeds:  # (a plain step feeds a head at times: runner.launch)
                    for _ in range(CAPTURE_AFTER):
                        runner.lengths[rows[:size]] = context
                        runner.step(rows[:size], mode, context + mode.depth + 1, nodes, feed=feed)
                progress(f"{mode.name} at {size} rows")
        fed = max((chunks for chunks, _ in prompts), default=0)  # (request slots: at most max_batch chunks)
        lengths = runner.host_lengths[:fed]
        runner.host_lengths[:fed] = [runner.tokens.shape[1] - 1] * fed  # (every chunk is within its prompt)
        for chunks, tokens in prompts:
            feeds = [(row, 0, tokens // chunks + (row < tokens % chunks)) for row in range(chunks)]
            for _ in range(CAPTURE_AFTER):
                runner.drafted[:chunks] = [0] * chunks
                runner.prefill(feeds)
            progress(f"prompt forwards of {tokens} tokens in {chunks} chunks")
        runner.host_lengths[:fed] = lengths
        runner.drafted[:fed] = [0] * fed


def step_seconds(runner: Runner, mode: Mode, size: int, budget: int | None, context: int,
                 agree: Agree = same) -> tuple[float, float]:
    """(draft, verify) seconds of a step of `size` requests at `context` committed tokens in `mode`
    (with `budget` nodes where given), by the runner's clock: the fastest of TIMINGS steps, as
    `agree` makes it (the slowest rank's, where several run the step)."""
    best = None
    with borrowed(runner, size, context) as rows, torch.inference_mode():
        for attempt in range(WARMUP + TIMINGS):
            runner.lengths[rows] = context
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
    speculative modes, None: each request its tree's). Modes are timed shallowest first; one whose
    timing would outlast TIMING_BUDGET, by the time the deepest timed so far took a draft level and a
    verification at the smallest size, is not timed, and has no entry (a policy does not run it)."""
    def nodes(mode: Mode, c: int) -> int | None:
        return None if budget is None or mode.drafter is None else budget(c, mode.nodes)

    costs, phases = {}, {}  # phases: (draft, verify) seconds at the smallest size, by depth timed
    for mode in sorted(modes, key=lambda m: m.depth):
        deepest = max((d for d in phases if d > 0), default=None)
        if deepest is not None and mode.depth > deepest:
            draft, verify = phases[deepest]
            predicted = (draft * mode.depth / deepest + verify) * (WARMUP + TIMINGS) * len(sizes)
            if predicted > TIMING_BUDGET:
                log.warning("%s is not timed, so the policy will not run it: timing it would take about %.0f s, "
                            "more than the %.0f s allowed a mode (its drafts alone about %.1f s a step)",
                            mode.name, predicted, TIMING_BUDGET, draft * mode.depth / deepest)
                continue
        timed = {c: step_seconds(runner, mode, c, nodes(mode, c), context, agree) for c in sizes}
        phases[mode.depth] = timed[sizes[0]]
        costs[mode.name] = {c: sum(seconds) for c, seconds in timed.items()}
        log.debug("a step of %s: %s ms at batch sizes %s", mode.name,
                 ", ".join(f"{1e3 * s:.2f}" for s in costs[mode.name].values()), sizes)
    return {mode.name: costs[mode.name] for mode in modes if mode.name in costs}


def prompt_token_seconds(runner: Runner, chunk: int, agree: Agree = same) -> float:
    """Seconds a prompt token costs the drafter: its forward over one prompt chunk of the engine's
    share of `chunk` tokens (as a speculating engine's prompt forwards and `sync_drafter` feed it; a
    captured bucket where steps are captured), the fastest of TIMINGS, per token. What speculation
    adds to each prompt and plain decoding does not; 0 for a head (fed the target's features in every
    mode) or no drafter."""
    if runner.drafter is None or runner.features is not None:
        return 0.0
    tokens = min(chunk, *(stage.max_step_tokens for stage in runner.stages))
    best = float("inf")
    with borrowed(runner, 1, 0), torch.inference_mode():
        length = runner.host_lengths[0]
        runner.host_lengths[0] = tokens + CATCH_UP  # (the drafter is fed all but the last CATCH_UP)
        for attempt in range(WARMUP + TIMINGS):
            runner.drafted[0] = 0
            clock = runner.clock(runner.device)
            clock.mark()
            runner.sync_drafter([0], tokens)
            clock.mark()
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            if attempt >= WARMUP:
                best = min(best, clock.seconds()[0])
        runner.host_lengths[0], runner.drafted[0] = length, 0
    log.debug("a prompt token costs the drafter %.2f us (its forward over %d tokens)", 1e6 * best / tokens, tokens)
    return agree((best / tokens,))[0]


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
        log.debug("batch size %d verifies at most %d nodes", c, c * low)
    return table

