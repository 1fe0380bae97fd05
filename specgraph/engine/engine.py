"""The engine: requests in, tokens out, many requests at once.

Each `step` admits the waiting requests that fit (a request slot and the blocks of its longest
sequence: scheduler.py), feeds those still prefilling a chunk of prompt tokens in all, earliest
first, in one forward per stage, and decodes every request whose prompt is in, together
(runner.py): a finished request's place goes to the next waiting one at the next step. `Program.generate`, `specgraph run --batch`, `bench` and
the HTTP server all drive it. Tokenizing lives at the edges; the engine sees token ids.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from specgraph.engine.budget import Budget
from specgraph.engine.pool import BlockPool
from specgraph.engine.request import DECODE, FINISHED, Request
from specgraph.engine.runner import Runner
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


class Engine:
    def __init__(self, runner: Runner, eos_ids: tuple[int, ...], max_seq_len: int, slots: int, pool: BlockPool,
                 region: int, prefill_chunk: int, sampling: SamplingSpec, budget: Budget | None = None):
        """`slots`: requests in flight at most; `region`: virtual slots a step writes past a
        request's committed tokens (the largest of its stages'); `sampling`: the recipe's settings,
        which requests take where they give none; `budget`: the draft nodes a step verifies over
        its whole batch (budget.py), None: each request its tree's."""
        self.runner, self.eos_ids, self.max_seq_len = runner, tuple(eos_ids), max_seq_len
        self.prefill_chunk = prefill_chunk  # prompt tokens a step feeds, over its newcomers
        # a prompt's tokens in one forward (a hybrid stage folds at most its step buffers' per request)
        self.prefill_share = min(prefill_chunk, *(stage.max_step_tokens for stage in runner.stages))
        self.region, self.sampling, self.budget = region, sampling, budget
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
        return self.scheduler.busy

    @property
    def limit(self) -> int:
        """Requests decoded at once at most (at most the request slots)."""
        return self.scheduler.limit

    @limit.setter
    def limit(self, value: int) -> None:
        self.scheduler.limit = value

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """One step -> the requests that got tokens in it (each finished one is out of the engine)."""
        for request in self.scheduler.admit():
            self.runner.start(request.slot, request.blocks, request.prompt, request.sampling, request.stops,
                              request.min_tokens)
        chunks, left = [], self.prefill_chunk  # (slot, start, end) of each newcomer fed; prompt tokens still to give
        for newcomer in self.scheduler.prefilling():  # (all but a prompt's last token: the first step feeds it)
            if left == 0:
                break
            end = min(newcomer.fed + min(left, self.prefill_share), len(newcomer.prompt) - 1)
            chunks.append((newcomer.slot, newcomer.fed, end))
            left -= end - newcomer.fed
            newcomer.fed = end
            if end == len(newcomer.prompt) - 1:
                newcomer.status = DECODE
        self.runner.prefill(chunks)
        running = self.scheduler.decoding()
        if not running:
            return []
        budget = None if self.budget is None else self.budget(len(running))
        news, clock = self.runner.decode([r.slot for r in running], budget)
        draft_s, verify_s = clock.seconds()
        nodes = budget if budget is not None else len(running) * (self.runner.drafter.nodes if self.runner.drafter else 0)
        totals = self.totals
        totals.steps, totals.requests, totals.nodes = totals.steps + 1, totals.requests + len(running), totals.nodes + nodes
        totals.draft_seconds, totals.verify_seconds = totals.draft_seconds + draft_s, totals.verify_seconds + verify_s
        now = time.perf_counter()
        for request, new in zip(running, news):
            gen = request.generation
            request.steps += 1
            gen.target_steps += 1
            gen.draft_seconds += draft_s
            gen.verify_seconds += verify_s
            done = request.output.take(new)
            if request.steps == 1:
                gen.first_token_seconds = now - request.arrival
            if done:
                gen.seconds = now - request.arrival
                self.scheduler.finish(request)
                del self.requests[request.id]
        return running

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        """One request, decoded to its end (with whatever else is in flight) -> its Generation."""
        request = self.add_request(prompt_ids, max_new_tokens, self.sampling.model_copy(update={"seed": seed}))
        while request.status != FINISHED:
            self.step()
        return request.generation
