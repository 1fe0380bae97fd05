"""Reference SwiGLU of the MLP's fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specgraph.kernels.linear.reference import linear_reference


def swiglu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K]; weight [2I, K] (gate rows, then up rows) -> silu(gate) * up [..., I]."""
    gate, up = linear_reference(x, weight, bias).chunk(2, dim=-1)
    return F.silu(gate) * up
