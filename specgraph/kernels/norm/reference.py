"""Reference RMSNorm (normalise in fp32, cast back, then scale: as transformers' Llama does)."""

from __future__ import annotations

import torch


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C], weight [C] -> [..., C] in x's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rmsnorm_reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., C] -> (x + delta, rmsnorm(x + delta)), both in x's dtype."""
    total = x + delta
    return total, rmsnorm_reference(total, weight, eps)
