"""The engine: requests in, tokens out, many requests at once.

Each `step` admits the waiting requests that fit (a request slot and the blocks of its longest
sequence: scheduler.py), feeds those still prefilling a chunk of prompt tokens in all, earliest
first, in one forward per stage, and launches a decoding step of every request whose prompt is in,
together (runner.py), in the mode its policy chooses (policy.py: plain decoding or speculation);
then it collects the step launched before, so that the device runs one step while the host
prepares the next. A request that finished in the step collected is in the step just launched: its
tokens there are dropped, and its place goes to the next waiting one (the device runs the steps in
order, so nothing enqueued after can touch what that step still uses). `Program.generate`,
`specgraph run --batch`, `bench` and the HTTP server all drive it. Tokenizing lives at the edges;
the engine sees token ids.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from specgraph.engine.budget import Budget
from specgraph.engine.policy import Acceptance, Policy
from specgraph.engine.pool import BlockPool
from specgraph.engine.request import DECODE, FINISHED, Request
from specgraph.engine.runner import Launched, Mode, Runner
from specgraph.engine.scheduler import Scheduler
from specgraph.errors import PromptError
from specgraph.recipe import SamplingSpec
from specgraph.sampling import STOP_IDS
from specgraph.runtime.executor import Generation, Output


@dataclass
class StepTotals:
    """What the engine's steps did, summed (a benchmark reads and resets them)."""

    steps: int = 0
    requests: int = 0  # requests decoded, over the steps
    nodes: int = 0  # draft nodes verified, over the steps
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    modes: dict[str, int] = field(default_factory=dict)  # steps of each mode
    decode_tokens: int = 0  # tokens of the steps launched with no prompt chunk beside them
    decode_seconds: float = 0.0  # from the collection before each such step to its own
    # by mode, over its steps whose cost the policy charged: [steps, tokens/s the policy expected of them (summed),
    # their tokens, their seconds as the engine lived them]
    lived: dict[str, list[float]] = field(default_factory=dict)

    def rates(self) -> dict[str, dict[str, float]]:
        """Each mode's expected (the policy's mean) and realised output tokens per second, over its
        steps whose cost the policy charged."""
        return {mode: {"steps": steps, "expected": expected / steps, "realised": tokens / seconds}
                for mode, (steps, expected, tokens, seconds) in self.lived.items() if steps and seconds}


@dataclass
class InFlight:
    """A launched step: its requests, in its rows' order, and the draft nodes it verifies."""

    launched: Launched
    requests: list[Request]
    nodes: int
    prefilled: bool  # whether a prompt chunk was fed beside it (before it, or before its collection)
    expected: float | None = None  # the output tokens per second the policy expected of it


class Engine:
    def __init__(self, runner: Runner, eos_ids: tuple[int, ...], max_seq_len: int, slots: int, pool: BlockPool,
                 region: int, prefill_chunk: int, sampling: SamplingSpec, budget: Budget | None = None,
                 policy: Policy | None = None):
        """`slots`: requests in flight at most; `region`: virtual slots a step writes past a
        request's committed tokens (the largest of its stages'); `sampling`: the recipe's settings,
        which requests take where they give none; `budget`: the draft nodes a step verifies over
        its whole batch (budget.py), None: each request its tree's; `policy`: chooses each step's
        mode (policy.py), None: every step speculates with the recipe's tree (plain decoding
        without a drafter)."""
        self.runner, self.eos_ids, self.max_seq_len = runner, tuple(eos_ids), max_seq_len
        self.prefill_chunk = prefill_chunk  # prompt tokens a step feeds, over its newcomers
        # a prompt's tokens in one forward (a hybrid stage folds at most its step buffers' per request)
        self.prefill_share = min(prefill_chunk, *(stage.max_step_tokens for stage in runner.stages))
        self.region, self.sampling, self.budget, self.policy = region, sampling, budget, policy
        self.always = runner.modes[min(1, len(runner.modes) - 1)]  # without a policy: the recipe's tree, or plain
        self._in_flight: InFlight | None = None
        self._collected_at: float | None = None  # when the last step was collected, while steps follow each other
        self._lived_at: float | None = None  # the same by the runner's clock (what the policy charges a step)
        self.scheduler = Scheduler(pool, slots, self._slots_needed)
        self.device = runner.device
        self.totals = StepTotals()
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}

    def _slots_needed(self, request: Request) -> int:
        return min(len(request.prompt) + request.max_new_tokens, self.max_seq_len) + self.region

    def add_request(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingSpec | None = None,
                    request_id: str | None = None, stops: tuple[int, ...] | None = None,
                    min_tokens: int = 0) -> Request:
        """Queue a request (its settings: the recipe's where not given) -> its handle; a prompt that
        cannot be decoded is refused here (PromptError), before it takes any place. `stops`: the
        tokens that end it (None: the model's end-of-sequence tokens); `min_tokens`: new tokens it
        has before any of them may be drawn."""
        if not 0 < len(prompt_ids) < self.max_seq_len:
            raise PromptError(f"a prompt of {len(prompt_ids)} tokens does not fit: prompts need 1 to "
                              f"{self.max_seq_len - 1} tokens (max_seq_len {self.max_seq_len})", "prompt")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise PromptError(f"max_new_tokens: must be a whole number of at least 1 (got {max_new_tokens!r})",
                              "max_new_tokens")
        sampling = sampling or self.sampling
        if (sampling.temperature > 0) != (self.sampling.temperature > 0):
            raise PromptError(f"temperature {sampling.temperature}: this program verifies "
                              f"{'by sampling' if self.sampling.temperature > 0 else 'greedily'}; give a temperature "
                              f"{'above 0' if self.sampling.temperature > 0 else 'of 0'}, or a recipe that does",
                              "temperature")
        stops = self.eos_ids if stops is None else tuple(dict.fromkeys(stops))
        vocab = self.runner.verifier.stage.logits_width
        if len(stops) > STOP_IDS or not all(0 <= t < vocab for t in stops):
            raise PromptError(f"stop_token_ids: a request has at most {STOP_IDS} stop tokens (the end-of-sequence "
                              f"tokens {list(self.eos_ids)} among them unless it ignores them), ids 0 to {vocab - 1} "
                              f"(got {list(stops)})", "stop_token_ids")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise PromptError(f"request id {request_id!r} is in use")
        generation = Generation(output_ids=[])
        output = Output(generation, len(prompt_ids), max_new_tokens, self.max_seq_len, stops)
        request = Request(request_id, list(prompt_ids), max_new_tokens, sampling, output, stops=stops,
                          min_tokens=min_tokens)
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is; its place goes to the next."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request)

    @property
    def busy(self) -> bool:
        return self.scheduler.busy or self._in_flight is not None

    @property
    def limit(self) -> int:
        """Requests decoded at once at most (at most the request slots)."""
        return self.scheduler.limit

    @limit.setter
    def limit(self, value: int) -> None:
        self.scheduler.limit = value

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Launch one step and collect the one before -> the requests that got tokens in that one
        (each finished one is out of the engine)."""
        for request in self.scheduler.admit():
            request.generation.queued_seconds = time.perf_counter() - request.arrival
            end = len(request.prompt) + request.output.budget
            self.runner.start(request.slot, request.blocks, request.prompt, request.sampling, end, request.stops,
                              request.min_tokens)
            if self.policy is not None:
                request.acceptance = Acceptance(self.policy.depth)
        prefilled = self._prefill()
        running = self._running()  # (in admission order)
        previous, self._in_flight = self._in_flight, None
        if prefilled and previous is not None:  # (its collection comes after that prompt forward: on a CPU, behind it)
            previous.prefilled = True
        done = []
        if running:
            rows = self.runner.step_rows(len(running))
            if self.policy is not None:
                for request in running:  # (policy.py's f_r)
                    request.acceptance.feeds_per_token = max(len(request.prompt) / request.output.budget,
                                                             self.runner.missed(request.slot) / max(request.output.room, 1))
            # (chosen for the batch it is heading to, newcomers included: not a drafter synced for a few
            # requests while the prompts of a batch that will decode plainly go in)
            heading = self.runner.step_rows(len(running) + len(self.scheduler.prefilling()))
            mode = self.always if self.policy is None else self.policy.choose([r.acceptance for r in running], heading)
            if mode.drafter is not None and self.budget is not None and self.budget(rows, mode.nodes) == 0:
                mode = self.runner.modes[0]  # (a budget that verifies no node: nothing to draft for)
            if mode.drafter is not None and any(r.behind for r in running):  # its drafter first fed what it missed
                done += self._collect(previous) if previous is not None else []
                previous, running = None, self.scheduler.decoding()  # (exact lengths: nothing in flight)
                self.runner.sync_drafter([r.slot for r in running if r.behind], self.prefill_chunk)
                for request in running:
                    request.behind = False
            if running:
                self._launch(running, mode, previous is not None, prefilled)
        if previous is not None:
            done += self._collect(previous)
        if self._in_flight is None:
            self._collected_at = self._lived_at = None
        return done

    def _prefill(self) -> bool:
        """Feed the newcomers a chunk of prompt tokens in all, earliest first (all but each prompt's
        last token: the first step feeds it); their drafter too where the engine speculates at the
        batch it holds, newcomers included (else they catch up if a step speculates) -> whether any
        prompt token was fed."""
        chunks, left = [], self.prefill_chunk  # (slot, start, end) of each newcomer fed; prompt tokens still to give
        for newcomer in self.scheduler.prefilling():
            if left == 0:
                break
            end = min(newcomer.fed + min(left, self.prefill_share), len(newcomer.prompt) - 1)
            chunks.append((newcomer.slot, newcomer.fed, end))
            left -= end - newcomer.fed
            newcomer.fed = end
        self.runner.prefill(chunks, drafter=bool(chunks) and self._feeds_drafter())
        for newcomer in self.scheduler.prefilling():
            if newcomer.fed == len(newcomer.prompt) - 1:
                newcomer.status = DECODE
                newcomer.behind = bool(self.runner.lagging([newcomer.slot]))
        return any(end > start for _, start, end in chunks)

    def _feeds_drafter(self) -> bool:
        """Whether prompt forwards feed the drafter: with a policy, where it expects speculation to pay
        for the requests the engine holds (at batch 64, where it decodes plainly, newcomers' prompts
        would cost the drafter a forward for nothing: run 126); without, where every step speculates."""
        if self.policy is None:
            return self.always.drafter is not None
        held = self._running() + self.scheduler.prefilling()  # (the batch ahead, as a step's mode counts it)
        feeds = sum(len(r.prompt) / r.output.budget for r in held) / max(len(held), 1)  # (policy.py's f_r)
        return self.policy.pays_at(self.runner.step_rows(max(len(held), 1)), feeds)

    def _running(self) -> list[Request]:
        """The requests decoding, less those the step in flight ends (its budget's last token)."""
        ending = set() if self._in_flight is None else {r.id for r in self._in_flight.requests if r.output.room <= 1}
        return [r for r in self.scheduler.decoding() if r.id not in ending]

    def _launch(self, running: list[Request], mode: Mode, in_flight: bool, prefilled: bool) -> None:
        rows = self.runner.step_rows(len(running))  # (a budget is that of the step's rows, padding among them)
        budget = None if self.budget is None or mode.drafter is None else self.budget(rows, mode.nodes)
        launched = self.runner.launch([r.slot for r in running], mode, budget, in_flight)
        nodes = len(running) * mode.nodes  # (a budget's nodes go to live rows only, each at most its tree's)
        self._in_flight = InFlight(launched, running, nodes if budget is None else min(budget, nodes), prefilled,
                                   None if self.policy is None else self.policy.expected)
        if mode.drafter is None:
            for request in running:
                request.behind = True

    def _collect(self, step: InFlight) -> list[Request]:
        """Wait for a launched step and give its requests their tokens -> those still in the engine
        when it was collected (a request that finished before it gets none)."""
        keep = [not r.finished for r in step.requests]
        news, (draft_s, verify_s) = self.runner.collect(step.launched, keep)
        mode, running = step.launched.mode, [r for r, kept in zip(step.requests, keep) if kept]
        totals = self.totals
        totals.steps, totals.requests, totals.nodes = totals.steps + 1, totals.requests + len(step.requests), totals.nodes + step.nodes
        totals.draft_seconds, totals.verify_seconds = totals.draft_seconds + draft_s, totals.verify_seconds + verify_s
        totals.modes[mode.name] = totals.modes.get(mode.name, 0) + 1
        lived = self.runner.clock.now()
        charged = self._lived(step, lived)
        if self.policy is not None:  # (a request that finished before the step may have run as the padding row)
            self.policy.observe(mode, [len(new) for new, kept in zip(news, keep) if kept],
                                [r.acceptance for r in running], step.launched.rows, charged)
        self._lived_at = lived
        now, tokens = time.perf_counter(), 0
        for request, new in ((r, n) for r, n, kept in zip(step.requests, news, keep) if kept):
            gen = request.generation
            before = len(gen.output_ids)
            request.steps += 1
            gen.target_steps += 1
            gen.draft_seconds += draft_s
            gen.verify_seconds += verify_s
            done = request.output.take(new)
            tokens += len(gen.output_ids) - before
            if request.steps == 1:
                gen.first_token_seconds = now - request.arrival
            if done:
                gen.seconds = now - request.arrival
                self.scheduler.finish(request)
                del self.requests[request.id]
        if self._collected_at is not None and not step.prefilled:
            totals.decode_tokens, totals.decode_seconds = totals.decode_tokens + tokens, totals.decode_seconds + now - self._collected_at
        if step.expected is not None and charged is not None:
            entry = totals.lived.setdefault(mode.name, [0, 0.0, 0, 0.0])
            entry[0], entry[1] = entry[0] + 1, entry[1] + step.expected
            entry[2], entry[3] = entry[2] + tokens, entry[3] + charged
        self._collected_at = now
        return running

    def _lived(self, step: InFlight, lived: float) -> float | None:
        """What `step` cost the engine, collected at `lived` (its clock's time): the time since the
        step before it was collected, while steps follow each other: its device time, any host stall
        and what ran before it for its sake (a drafter fed the tokens it missed); None where that says
        nothing of its mode's cost: a prompt chunk fed beside it, its shape's first run or capture,
        or no step collected just before."""
        if self._lived_at is None or step.prefilled or not step.launched.steady:
            return None
        return lived - self._lived_at

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        """One request, decoded to its end (with whatever else is in flight) -> its Generation."""
        request = self.add_request(prompt_ids, max_new_tokens, self.sampling.model_copy(update={"seed": seed}))
        while request.status != FINISHED:
            self.step()
        return request.generation
