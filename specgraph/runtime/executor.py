"""The executor interface: every execution style turns a prompt into a `Generation` behind it.

`Program` asks `make_executor` for the one its recipe's `execution` names; `specgraph run` and
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
    clipped: bool = False  # max_seq_len cut the request short of max_new_tokens
    seconds: float = 0.0
    first_token_seconds: float = 0.0  # prompt in, first step's tokens out
    draft_seconds: float = 0.0  # device time of the draft phases (GPU: CUDA events)
    verify_seconds: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)  # what an executor measures besides (see its docstring)


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
