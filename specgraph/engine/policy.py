"""Which mode a step runs: plain decoding or speculation at one of the recipe's tree depths, the
one expected to give the batch it runs the most output tokens per second:

    rate(m) = sum_r E_r[tokens per step | m] / (T(m, n) + c sum_r E_r[tokens per step | m] f_r)

over the batch's requests r. T(m, n) is the time of a real step in mode m of n rows (the batch and
its padding rows where steps are captured: runner.step_rows; `StepCosts`: measured when the engine
starts, then each step's own time). The second term is what the drafter's feeding costs, which
plain decoding skips (at c seconds a token, calibrate.py; a head is fed the target's features in
every mode: c = 0): f_r = max(L_r / N_r, B_r / R_r), the request's L_r prompt tokens spread over
the N_r tokens it may get (a speculating engine feeds the drafter every prompt), or, where the
drafter missed B_r of its tokens while the engine decoded plainly, those spread over the R_r tokens
it may still get, whichever is more. Without the first, a policy at batch 32, where speculation
about breaks even in its steps, speculated and lost to the drafter's prompts (runs 113 and 120:
0.94x `ar`); without the second, one at batch 64 went back to speculation as the batch drained and
fed the drafter hundreds of missed tokens a request for a few steps' gain (run 120: 0.88x `ar`).
E_r comes from per-depth acceptance rates: p_k, the chance a step accepts a draft at depth k
once it accepted one at depth k - 1, so a tree cut at depth d gives E = 1 + sum_{k <= d} p_1 ... p_k.
Rates are kept per shape (`Mode.shape`): a chain, one node a depth, accepts less at each depth than
a tree of several children a node, and run 113 (one H100, the EAGLE-3 head at batch 1) priced its
trees with the chains' rates and kept to chains. Each request has its own counts, drawn toward the
batch-wide rates of the shape, drawn in turn toward those of every shape together (themselves drawn
toward a prior) while it has few (`Acceptance`); a depth with few counts is drawn toward the rate of
the depth above it (PRIOR at depth 1), not toward a fixed prior: a policy that ran only shallow trees
has seen nothing of the deeper depths, and a pessimistic guess there would keep it shallow for good
(the depths a drafter gets right tend to follow one another). Plain decoding gives 1 token at its
own cost and is always a candidate, so no step is expected to be slower than plain decoding.

Speculation replaces the current mode only for a gain above `HYSTERESIS` (a switch from plain
decoding first feeds the drafter what it missed); plain decoding replaces speculation for any gain
(run 113 kept depth 1 at batch 32 while it was within 5% of `ar`, below it). Nothing is learned of
a shape that does not run:
every `PROBE` steps of one mode (doubling each time the probe does not win) one step runs the best
mode of another speculative shape that could win were every draft accepted, so that a drafter (or a
shape of its trees) whose acceptance was underrated gets its chance, and one that could never pay is
never run. A drafter that skipped steps is fed what it missed before it drafts again
(runner.sync_drafter).
"""

from __future__ import annotations

from specgraph.engine.runner import Mode

HYSTERESIS = 0.05  # a speculative mode replaces the current one only if its rate is this much higher
PROBE = 16  # steps of one mode before the first probe of another shape (then doubling, up to PROBE_MOST)
PROBE_MOST = 1024
PRIOR = 0.5  # depth 1's acceptance rate before any is seen (a deeper depth's: the rate above it)
PRIOR_WEIGHT = 4.0  # pseudo-trials of the prior in the batch-wide rates, and of those in a request's
DECAY = 0.99  # the batch-wide counts' weight after each observation (old requests' acceptance fades)
STEP_CHANGE = 0.1  # the largest share by which one step's time moves its mode's cost
DRIFT = 0.02  # share of the way back to its measured time a mode not running moves at each step of its size


class Acceptance:
    """Per-depth counts of each shape: at depth k, `trials[shape][k]` steps that accepted every draft
    above depth k and could accept one there, `hits[shape][k]` of them that did."""

    def __init__(self, depth: int, feeds_per_token: float = 0.0):
        """`feeds_per_token`: f_r, the drafter's tokens to feed for the request per token it gets (the
        engine keeps it current)."""
        self.depth, self.feeds_per_token = depth, feeds_per_token
        self.trials: dict[str, list[float]] = {}
        self.hits: dict[str, list[float]] = {}

    def observe(self, accepted: int, depth: int, shape: str, weight: float = 1.0) -> None:
        """A step of `shape` that could accept `depth` drafts accepted `accepted`."""
        trials = self.trials.setdefault(shape, [0.0] * (self.depth + 1))
        hits = self.hits.setdefault(shape, [0.0] * (self.depth + 1))
        for k in range(1, min(accepted + 1, depth) + 1):
            trials[k] += weight
            hits[k] += weight * (k <= accepted)

    def rates(self, prior: list[float] | float, weight: float, shape: str | None = None) -> list[float]:
        """p_k for k = 1 .. depth of `shape` (None: every shape's counts together), drawn toward
        `prior` (a rate per depth [depth], or one number: depth 1's, each deeper depth's then the rate
        found above it) with `weight` pseudo-trials."""
        shapes = list(self.trials) if shape is None else [shape] if shape in self.trials else []
        rates, above = [], prior
        for k in range(1, self.depth + 1):
            h, t = sum(self.hits[s][k] for s in shapes), sum(self.trials[s][k] for s in shapes)
            guess = prior[k - 1] if isinstance(prior, list) else above
            above = (h + weight * guess) / (t + weight)
            rates.append(above)
        return rates

    def decay(self, factor: float) -> None:
        for counts in (*self.trials.values(), *self.hits.values()):
            counts[:] = [c * factor for c in counts]


def expected_tokens(rates: list[float], depth: int) -> float:
    """E[tokens a step gives] with a tree cut at `depth`: the bonus and each depth's acceptance."""
    total, reach = 1.0, 1.0
    for p in rates[:depth]:
        reach *= p
        total += reach
    return total


class StepCosts:
    """Seconds of a step by mode name and batch size: measured ones, and between them a straight
    line (past the largest measured, the line through the last two). The engine's steps refine them
    (`observe`); a mode that stops running drifts back toward what was measured of it when the
    engine started, since what it last cost (a stall, a busy moment) may no longer hold."""

    def __init__(self, table: dict[str, dict[int, float]] | None = None):
        self.table = {name: dict(by_size) for name, by_size in (table or {}).items()}
        self.measured = {name: dict(by_size) for name, by_size in self.table.items()}

    def observe(self, mode: str, size: int, seconds: float, weight: float = 0.2) -> None:
        """A step's time, averaged into what was known of its mode and size, moving it by at most
        STEP_CHANGE (a lone stall of the host is not its mode's cost; a lasting change gets there in a
        few steps); the other modes' times at that size move DRIFT of the way back toward their
        measured ones."""
        by_size = self.table.setdefault(mode, {})
        if size not in by_size:
            by_size[size] = seconds
        else:
            known = by_size[size]
            by_size[size] = known + max(-STEP_CHANGE * known, min(weight * (seconds - known), STEP_CHANGE * known))
        for name, measured in self.measured.items():
            if name != mode and size in measured and size in self.table[name]:
                self.table[name][size] += DRIFT * (measured[size] - self.table[name][size])

    def seconds(self, mode: str, size: int) -> float:
        by_size = self.table[mode]
        if size in by_size:
            return by_size[size]
        below, above = [s for s in sorted(by_size) if s < size], [s for s in sorted(by_size) if s > size]
        if not below:
            return by_size[above[0]]
        if not above and len(below) == 1:
            return by_size[below[0]] * size / below[0]  # (one size measured: as if a step's cost grew with its batch)
        lo, hi = (below[-1], above[0]) if above else (below[-2], below[-1])
        slope = (by_size[hi] - by_size[lo]) / (hi - lo)
        return max(by_size[lo] + slope * (size - lo), 0.0)


class Policy:
    def __init__(self, modes: list[Mode], costs: StepCosts, prior: float = PRIOR, budget=None, timed: bool = True,
                 prompt_token_seconds: float = 0.0):
        """`modes`: plain decoding first, then speculation, deepest first; `budget`: the batch-wide
        budget (budget.py) where one bounds the nodes (a mode whose step would verify none is no candidate);
        `timed`: each step's time refines `costs` (not where several ranks take the same decisions:
        each rank's clock would part them); `prompt_token_seconds`: c, the drafter's time a prompt token."""
        self.modes, self.costs, self.budget, self.timed = modes, costs, budget, timed
        self.prompt_token_seconds = prompt_token_seconds
        self.depth = max(m.depth for m in modes)
        self.prior = prior
        self.batchwide = Acceptance(self.depth)
        self.current = max(self.candidates(1), key=lambda m: self.rate(m, [Acceptance(self.depth)]))  # a priori, alone
        self.unprobed, self.probe_every = 0, PROBE  # steps of the current mode since it began or was probed away from
        self.expected: float | None = None  # the output tokens per second it expected of the mode it chose last

    def rate(self, mode: Mode, acceptances: list[Acceptance], rows: int | None = None, prompts: bool = True) -> float:
        """Expected output tokens per second of a step in `mode` of requests with these acceptance
        counts, run as `rows` rows (default: one per request), with its share of the drafter's prompt
        forwards (`prompts`: else the step's alone, what the engine's steps realise)."""
        pooled = self.batchwide.rates(self.prior, PRIOR_WEIGHT)
        shared = self.batchwide.rates(pooled, PRIOR_WEIGHT, mode.shape)
        tokens = [expected_tokens(a.rates(shared, PRIOR_WEIGHT, mode.shape), mode.depth) for a in acceptances]
        return self._per_second(mode, tokens, acceptances, rows, prompts)

    def ceiling(self, mode: Mode, acceptances: list[Acceptance], rows: int) -> float:
        """The rate of `mode` for requests with these acceptance counts in `rows` rows were every draft accepted."""
        return self._per_second(mode, [1.0 + mode.depth] * len(acceptances), acceptances, rows, True)

    def _per_second(self, mode: Mode, tokens: list[float], acceptances: list[Acceptance], rows: int | None,
                    prompts: bool) -> float:
        """Tokens per second of a step in `mode` giving each request its `tokens`, run as `rows` rows."""
        seconds = self.costs.seconds(mode.name, rows or len(acceptances))
        if prompts and mode.drafter is not None:
            seconds += self.prompt_token_seconds * sum(t * a.feeds_per_token for t, a in zip(tokens, acceptances))
        return sum(tokens) / max(seconds, 1e-9)

    def pays_at(self, size: int, feeds_per_token: float) -> bool:
        """Whether speculation is the best mode for `size` rows of requests of the batch's acceptance,
        each charged `feeds_per_token` prompt tokens of the drafter's a token (policy.py's f_r)."""
        alike = [Acceptance(self.depth, feeds_per_token=feeds_per_token)]  # (rates: one request's, same order)
        return max(self.candidates(size), key=lambda m: self.rate(m, alike, size)).drafter is not None

    def candidates(self, size: int) -> list[Mode]:
        """The modes a step of `size` requests may run: plain decoding, and speculation that verifies nodes."""
        return [m for m in self.modes if m.drafter is None or self.budget is None or self.budget(size, m.nodes) > 0]

    def choose(self, acceptances: list[Acceptance], rows: int | None = None) -> Mode:
        """The mode of the next step of requests with these acceptance counts (one per request), run
        as `rows` rows (default: one per request)."""
        rows = rows or len(acceptances)
        modes = self.candidates(rows)
        rates = {m.name: self.rate(m, acceptances, rows) for m in modes}
        if self.current not in modes:
            self.current = self.modes[0]
        best = max(modes, key=lambda m: rates[m.name])
        if rates[best.name] > rates[self.current.name] * (1 + (HYSTERESIS if best.drafter is not None else 0)):
            self.current, self.unprobed, self.probe_every = best, 0, PROBE
        mode = self.current
        self.unprobed += 1
        hopeful = [m for m in modes if m.drafter is not None and m.shape != mode.shape
                   and self.ceiling(m, acceptances, rows) > rates[mode.name]]
        if self.unprobed >= self.probe_every and hopeful:  # a probe of the best other shape that could win
            self.unprobed, self.probe_every = 0, min(2 * self.probe_every, PROBE_MOST)
            mode = max(hopeful, key=lambda m: rates[m.name])
        self.expected = self.rate(mode, acceptances, rows, prompts=False)
        return mode

    def observe(self, mode: Mode, counts: list[int], acceptances: list[Acceptance], size: int,
                seconds: float | None) -> None:
        """A collected step of `size` rows in `mode` and its seconds (None: a time that says nothing of
        its mode's cost, such as a first run or a capture): the count of new tokens of each request
        still decoding (its acceptance counts alongside)."""
        if self.timed and seconds is not None:
            self.costs.observe(mode.name, size, seconds)
        if mode.drafter is None:
            return
        self.batchwide.decay(DECAY)
        for count, acceptance in zip(counts, acceptances):
            acceptance.observe(count - 1, mode.depth, mode.shape)
            self.batchwide.observe(count - 1, mode.depth, mode.shape)
