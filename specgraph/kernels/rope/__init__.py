"""Rotary position embedding of q and k, fused with writing k and v into the cache."""

from specgraph.kernels.rope.reference import rope_write_reference

__all__ = ["rope_write_reference"]
