"""Greedy acceptance on the device: the longest root path whose every draft is the target's argmax."""

from specgraph.kernels.accept.reference import accept_greedy_reference

__all__ = ["accept_greedy_reference"]
