"""Acceptance on the device: the longest root path whose every draft is the target's (perturbed)
argmax, for the greedy and sampling rules."""

from specgraph.kernels.accept.reference import accept_greedy_reference

__all__ = ["accept_greedy_reference"]
