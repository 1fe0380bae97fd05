"""The engine's own thread: it alone touches the program (and so the device).

HTTP handlers (on the event loop's thread) put messages in its inbox: a Job to add, an id to
abort, a stop. Between messages it steps the engine, and answers each job through the `send` the
job came with (thread-safe: the server's puts the event on the job's asyncio queue): Accepted or
Refused first, then Tokens for every step that brought the job some (the last with its
Generation), or Failed. A serial program's engine decodes many jobs together (Batched); a
multi-process program decodes one job at a time, to its end (OneAtATime).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from specgraph.engine.engine import Engine
from specgraph.errors import PromptError
from specgraph.program import Program
from specgraph.recipe import SamplingSpec
from specgraph.runtime.executor import Generation
from specgraph.serve.metrics import Metrics
from specgraph.stack import on_a_stack_chunk_of_its_own

log = logging.getLogger("specgraph.serve")


@dataclass
class Accepted:
    """The job is in the engine: its tokens will come."""


@dataclass
class Refused:
    error: PromptError  # the job cannot be decoded (a prompt too long, a temperature the recipe cannot serve)


@dataclass
class Tokens:
    ids: list[int]  # the step's new tokens
    generation: Generation | None  # the job's, once it is finished (its finish_reason); else None
    stop_token: int | None = None  # the one of its stop_token_ids that ended it, if one did (vLLM's stop_reason)


@dataclass
class Failed:
    message: str  # why the job ends unfinished: a fault of the server (logged with its traceback), or its stop
    status: int = 500  # the HTTP status it means: 500 a fault, 503 the server stops


Event = Accepted | Refused | Tokens | Failed


@dataclass
class Job:
    id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingSpec
    send: Callable[[Event], None]  # called from the engine's thread
    ignore_eos: bool = False  # the end-of-sequence tokens do not end it
    stop_token_ids: tuple[int, ...] = ()  # more tokens that do
    min_tokens: int = 0  # new tokens before any of those may be drawn

    @property
    def own_stops(self) -> bool:
        """Whether it asks for a stopping rule of its own."""
        return self.ignore_eos or bool(self.stop_token_ids) or self.min_tokens > 0

    def stop_token(self, generation: Generation, eos_ids: tuple[int, ...]) -> int | None:
        """The token of its stop_token_ids that ended it, as vLLM reports it: None where it ended
        otherwise, or by an end-of-sequence token that ends it anyway (`eos_ids`: the model's)."""
        last = generation.output_ids[-1] if generation.output_ids else None
        if generation.finish_reason != "stop" or last not in self.stop_token_ids:
            return None
        return None if last in eos_ids and not self.ignore_eos else last


class Batched:
    """A serial program's engine: every running job decoded in each step."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.limit, self.eos_ids = engine.limit, engine.eos_ids

    def add(self, job: Job) -> None:
        stops = None if not job.own_stops else (*(() if job.ignore_eos else self.engine.eos_ids), *job.stop_token_ids)
        self.engine.add_request(job.prompt, job.max_tokens, job.sampling, job.id, stops, job.min_tokens)

    def abort(self, job_id: str) -> None:
        self.engine.abort(job_id)

    @property
    def busy(self) -> bool:
        return self.engine.busy

    def counts(self) -> tuple[int, int]:
        """(jobs running, jobs waiting for a place)"""
        scheduler = self.engine.scheduler
        return len(scheduler.admitted), len(scheduler.waiting)

    def modes(self) -> dict[str, int]:
        """The engine's steps so far by mode (its policy's choices)."""
        return dict(self.engine.totals.modes)

    def step(self) -> list[tuple[str, list[int], Generation | None]]:
        """One engine step -> (job id, its new tokens, its Generation if finished) per job it decoded."""
        out = []
        for request in self.engine.step():
            gen = request.generation
            new = gen.output_ids[len(gen.output_ids) - gen.accepted_lengths[-1]:]  # what this step added
            out.append((request.id, new, gen if request.finished else None))
        return out


class OneAtATime:
    """A multi-process program: its ranks decode one job at a time, with the recipe's sampling
    settings (only the seed is the job's). A job aborted while they decode it finishes unheard."""

    limit = 1
    eos_ids = ()  # (the only stop tokens of its jobs, which have none of their own: see add)

    def __init__(self, program: Program):
        self.program = program
        self.waiting: deque[Job] = deque()
        self.running = 0

    def add(self, job: Job) -> None:
        self.program.check(job.prompt, job.max_tokens)
        recipe = self.program.recipe.sampling
        for name in ("temperature", "top_p", "top_k"):
            if getattr(job.sampling, name) != getattr(recipe, name):
                raise PromptError(f"{name} {getattr(job.sampling, name)}: a multi-process program decodes with its "
                                  f"recipe's sampling ({name} {getattr(recipe, name)}); give that, or leave it out",
                                  name)
        if job.own_stops:
            field = "ignore_eos" if job.ignore_eos else "stop_token_ids" if job.stop_token_ids else "min_tokens"
            raise PromptError(f"{field}: a multi-process program ends a request at its end-of-sequence tokens only; "
                              "leave out ignore_eos, min_tokens and stop_token_ids, or serve a serial recipe", field)
        self.waiting.append(job)

    def abort(self, job_id: str) -> None:
        self.waiting = deque(job for job in self.waiting if job.id != job_id)

    @property
    def busy(self) -> bool:
        return bool(self.waiting)

    def counts(self) -> tuple[int, int]:
        return self.running, len(self.waiting)

    def modes(self) -> dict[str, int]:
        """(its ranks' steps are not counted here)"""
        return {}

    def step(self) -> list[tuple[str, list[int], Generation | None]]:
        job = self.waiting.popleft()
        self.running = 1
        try:
            gen = self.program.generate(job.prompt, job.max_tokens, job.sampling.seed)
        finally:
            self.running = 0
        return [(job.id, gen.output_ids, gen)]


class EngineLoop:
    """The thread that drives a backend (Batched or OneAtATime); `submit`, `abort` and `stop` may be
    called from any thread."""

    def __init__(self, backend: Batched | OneAtATime, metrics: Metrics):
        self.backend, self.metrics = backend, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[str, Job] = {}  # those in the backend, by id (the engine thread's alone)
        self._stopping = threading.Event()
        self._entry = threading.Lock()  # orders jobs and the stop in the inbox
        self.thread = threading.Thread(target=on_a_stack_chunk_of_its_own, args=(self._run,), name="specgraph-engine",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self._entry:  # (a job comes before the stop, and is answered, or after it, and is refused here)
            if self._stopping.is_set():
                job.send(Failed("the server is shutting down", 503))
            else:
                self._inbox.put(("add", job))

    def abort(self, job_id: str) -> None:
        self._inbox.put(("abort", job_id))

    def stop(self, within: float) -> bool:
        """Drop every job left and end the thread -> whether it ended within `within` seconds (a
        multi-process program's job in progress holds it until it ends or the program is closed)."""
        with self._entry:
            self._stopping.set()
            self._inbox.put(("stop", None))
        self.thread.join(within)
        return not self.thread.is_alive()

    def _run(self) -> None:
        while True:
            idle = not self.backend.busy
            while True:  # every message there is (waiting for one while there is nothing to decode)
                try:
                    kind, value = self._inbox.get(block=idle)
                except queue.Empty:
                    break
                idle = False
                if kind == "stop":
                    self._fail_all(Failed("the server is shutting down", 503))
                    return
                (self._add if kind == "add" else self._abort)(value)
            if self.backend.busy:
                self._step()

    def _add(self, job: Job) -> None:
        try:
            self.backend.add(job)
        except PromptError as exc:
            job.send(Refused(exc))
            return
        except Exception:  # noqa: BLE001 - a fault of ours: the job gets a 500, the server goes on
            log.exception("adding request %s failed", job.id)
            job.send(Failed("the server failed to queue the request (its log has the traceback)"))
            return
        self._jobs[job.id] = job
        job.send(Accepted())

    def _abort(self, job_id: str) -> None:
        if self._jobs.pop(job_id, None) is not None:
            self.backend.abort(job_id)

    def _step(self) -> None:
        try:
            decoded = self.backend.step()
        except Exception as exc:  # noqa: BLE001 - every job in flight fails with a 500; the server goes on
            if self._stopping.is_set():  # the server stopped a multi-process program's request: no fault
                self._fail_all(Failed("the server is shutting down", 503))
                return
            log.exception("a decoding step failed")
            self._fail_all(Failed(f"decoding failed: {(str(exc).strip().splitlines() or [type(exc).__name__])[0]}"))
            return
        if decoded:  # (a step may only feed a newcomer's prompt)
            self.metrics.step([len(new) for _, new, _ in decoded], self.backend.limit)
        for job_id, new, finished in decoded:
            job = self._jobs.get(job_id)
            if job is None:  # aborted while a multi-process program decoded it
                continue
            if finished is not None:
                del self._jobs[job_id]
            job.send(Tokens(new, finished, None if finished is None else job.stop_token(finished, self.backend.eos_ids)))

    def _fail_all(self, failure: Failed) -> None:
        for job_id, job in list(self._jobs.items()):
            self._abort(job_id)
            job.send(failure)
