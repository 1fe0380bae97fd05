"""Attention of a step's queries (one token, a catch-up chain or a draft tree) over a stage's KV
cache, under the step's mask (one [T, width] mask shared by every head and layer)."""

import torch

from specgraph.kernels.attention.reference import attention_reference

__all__ = ["attention_reference", "token_major_like"]


def token_major_like(q: torch.Tensor) -> torch.Tensor:
    """An empty output like q [B, H, T, K] whose memory is [B, T, H, K]: the caller's
    `.transpose(1, 2).reshape(B, T, H K)` before the output projection is then a view, not a copy."""
    b, h, t, k = q.shape
    return q.new_empty(b, t, h, k).transpose(1, 2)
