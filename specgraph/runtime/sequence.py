"""The committed tokens of one sequence, on a device."""

from __future__ import annotations

import torch


class Sequence:
    """`tokens` [capacity] long, the first `length` ([] long) committed. Both live on the device, so
    a step reads and advances them without the host."""

    def __init__(self, capacity: int, device: torch.device):
        self.tokens = torch.zeros(capacity, dtype=torch.long, device=device)
        self.length = torch.zeros((), dtype=torch.long, device=device)

    def start(self, prompt: torch.Tensor) -> None:
        self.tokens[: prompt.numel()] = prompt
        self.length.fill_(prompt.numel())

    def append(self, new: torch.Tensor, count: torch.Tensor) -> None:
        """Commit new[:count] (new [D + 1]; the rest is written past the end and ignored)."""
        self.tokens.index_copy_(0, self.length + torch.arange(new.numel(), device=new.device), new)
        self.length += count

    def copy_(self, other: Sequence) -> None:
        self.tokens.copy_(other.tokens)
        self.length.copy_(other.length)
