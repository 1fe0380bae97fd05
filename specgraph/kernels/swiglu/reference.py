"""Reference SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate, then up) -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
