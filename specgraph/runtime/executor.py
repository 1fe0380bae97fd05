"""The executor interface: every execution style turns a prompt into a `Generation` behind it.

`Program` asks `lower.build_executor` for the one its recipe's `execution` names (serial: the engine,
engine/); `specgraph run` and
`bench` only ever call `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch


@dataclass
class Generation:
    output_ids: list[int]  # new tokens only, ending at the first end-of-sequence token if one came
    target_steps: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # per target step: the tokens it added to the output
    # (accepted drafts + the bonus, fewer where the budget or an end-of-sequence token cut the step)
    finish_reason: str = ""  # "stop" (a stop token: end of sequence), "length" (max_new_tokens), "clipped" (max_seq_len)
    seconds: float = 0.0
    first_token_seconds: float = 0.0  # prompt in, first step's tokens out
    queued_seconds: float = 0.0  # of those, waiting for a place (many requests at once)
    draft_seconds: float = 0.0  # device time of the draft phases (GPU: CUDA events)
    verify_seconds: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)  # what an executor measures besides (see its docstring)

    @property
    def clipped(self) -> bool:
        """Whether max_seq_len cut the request short of max_new_tokens (not an end-of-sequence token)."""
        return self.finish_reason == "clipped"


class Output:
    """A request's output as its steps bring tokens: kept up to its budget (max_new_tokens, or
    fewer where max_seq_len leaves less room after the prompt) and through its first stop token
    (`stops`: the end-of-sequence tokens, or the request's own). Every executor keeps its output
    through one of these."""

    def __init__(self, generation: Generation, prompt_tokens: int, max_new_tokens: int, max_seq_len: int,
                 stops: tuple[int, ...]):
        self.generation = generation
        self.max_new_tokens = max_new_tokens
        self.budget = min(max_new_tokens, max_seq_len - prompt_tokens)
        self.stops = frozenset(stops)

    @property
    def room(self) -> int:
        """Tokens the output may still take."""
        return self.budget - len(self.generation.output_ids)

    def take(self, new: list[int]) -> bool:
        """Add one step's new tokens (as many as fit, through an end-of-sequence token) -> whether the output is done."""
        gen = self.generation
        new = new[: self.room]
        ended = next((i for i, t in enumerate(new) if t in self.stops), None)
        if ended is not None:
            new = new[: ended + 1]
        gen.output_ids.extend(new)
        gen.accepted_lengths.append(len(new))  # what the step added to the output
        if ended is not None:
            gen.finish_reason = "stop"
        elif self.room <= 0:
            gen.finish_reason = "length" if self.budget == self.max_new_tokens else "clipped"
        return bool(gen.finish_reason)


def total_stats(stats: Iterable[dict[str, float]]) -> dict[str, float]:
    """Generations' `stats` summed key by key (each request's own figures, over many requests)."""
    total: dict[str, float] = {}
    for one in stats:
        for key, value in one.items():
            total[key] = total.get(key, 0) + value
    return total


class Executor(Protocol):
    device: torch.device  # where the target runs (rank 0's device for a multi-process executor)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        """Decode up to `max_new_tokens` new tokens after `prompt_ids` (fewer at an end-of-sequence
        token or the end of the caches)."""
        ...
