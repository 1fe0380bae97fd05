"""Reference projections: the elementwise op, then F.linear (weight [N, K] as nn.Linear keeps it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specgraph.kernels.norm.reference import add_rmsnorm_reference
from specgraph.kernels.swiglu.reference import swiglu_reference


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N]."""
    return F.linear(x, weight, bias)


def norm_linear_reference(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., K] -> (x + delta, linear(rmsnorm(x + delta))) [..., K], [..., N]."""
    total, normed = add_rmsnorm_reference(x, delta, norm_weight, eps)
    return total, F.linear(normed, weight, bias)


def swiglu_linear_reference(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gate_up [..., 2K] (gate, then up) -> linear(silu(gate) * up) [..., N]."""
    return F.linear(swiglu_reference(gate_up), weight, bias)
