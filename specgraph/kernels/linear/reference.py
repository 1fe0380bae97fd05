"""Reference projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K]; weight [N, K] (as nn.Linear keeps it) -> [..., N]."""
    return F.linear(x, weight, bias)
