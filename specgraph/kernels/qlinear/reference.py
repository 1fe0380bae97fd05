"""Reference quantized projection: the weight dequantized, then nn.Linear's function."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specgraph.quant.linear import dequantize


def qlinear_reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      bias: torch.Tensor | None, format: str, group: int) -> torch.Tensor:
    """x [..., K]; a QuantLinear's weight, scales, zeros (None for fp8), bias, format and group ->
    [..., N] in x's dtype."""
    return F.linear(x, dequantize(weight, scales, zeros, format, group, x.shape[-1], x.dtype).to(x.dtype), bias)
