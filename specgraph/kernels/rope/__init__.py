"""Rotary position embedding of q and k, fused with writing k and v into the cache."""

from specgraph.kernels.rope.reference import apply_rotary, rope_write_reference

__all__ = ["apply_rotary", "rope_write_reference"]
