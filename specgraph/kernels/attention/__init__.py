"""Attention of a forward's packed queries (per segment: one token, a chain or a draft tree) over a
stage's paged KV cache, each seeing its request's committed prefix and the region offsets its
layout marks (specgraph/layout.py; the same inputs for every head and layer)."""

import torch

from specgraph.kernels.attention.reference import attention_reference

__all__ = ["attention_reference", "token_major_like"]


def token_major_like(q: torch.Tensor) -> torch.Tensor:
    """An empty output like q [B, H, T, K] whose memory is [B, T, H, K]: the caller's
    `.transpose(1, 2).reshape(B, T, H K)` before the output projection is then a view, not a copy."""
    b, h, t, k = q.shape
    return q.new_empty(b, t, h, k).transpose(1, 2)
