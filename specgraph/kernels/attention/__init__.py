"""Attention of a step's queries (one token, a catch-up chain or a draft tree) over a stage's KV
cache, under the step's mask (one [T, width] mask shared by every head and layer)."""

from specgraph.kernels.attention.reference import attention_reference

__all__ = ["attention_reference"]
