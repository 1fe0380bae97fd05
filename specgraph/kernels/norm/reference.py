"""Reference RMSNorm (normalise in fp32, cast back, then scale: as transformers' Llama does), gated or not."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      gate: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., C], weight [C] -> [..., C] in x's dtype; times silu(gate) [..., C] (in fp32) where
    given (the gated norm of Qwen3.5's DeltaNet layers)."""
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if gate is None else (normed * F.silu(gate.float())).to(x.dtype)


def add_rmsnorm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., C] -> (x + delta, rmsnorm(x + delta)), both in x's dtype."""
    total = x + delta
    return total, rmsnorm_reference(total, weight, eps)
