"""Reference quantized projection: the weight dequantized, then the reference projection (kernels/linear)."""

from __future__ import annotations

import torch

from specgraph.kernels.linear.reference import linear_reference
from specgraph.quant.linear import dequantize


def qlinear_reference(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      bias: torch.Tensor | None, format: str, group: int) -> torch.Tensor:
    """x [..., K]; a QuantLinear's weight, scales, zeros (None for fp8), bias, format and group ->
    [..., N] in x's dtype (the bias too, as the kernels add it: a quantized Linear may keep it in fp32)."""
    weight = dequantize(weight, scales, zeros, format, group, x.shape[-1], x.dtype).to(x.dtype)  # [N, K]
    return linear_reference(x, weight, None if bias is None else bias.to(x.dtype))
