"""A request: its prompt and settings, where it is in the engine, and its output so far."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specgraph.engine.policy import Acceptance
from specgraph.recipe import SamplingSpec
from specgraph.runtime.executor import Generation, Output

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


@dataclass
class Request:
    id: str
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingSpec  # its settings and seed
    output: Output  # where its tokens go (and its Generation: output.generation)
    stops: tuple[int, ...] = ()  # the tokens that end it
    min_tokens: int = 0  # new tokens before any of `stops` may be drawn
    arrival: float = field(default_factory=time.perf_counter)
    status: str = WAITING
    slot: int | None = None  # its row of every stage's block table, while admitted
    blocks: list[int] = field(default_factory=list)
    fed: int = 0  # prompt tokens the target holds (it holds all but the last once prefilled)
    steps: int = 0  # decoding steps it took part in
    acceptance: Acceptance | None = None  # its drafts' acceptance by depth, where a policy chooses the steps' modes
    behind: bool = True  # its drafter misses committed tokens that its catch-up does not feed

    @property
    def generation(self) -> Generation:
        return self.output.generation

    @property
    def finished(self) -> bool:
        return self.status == FINISHED
