"""Acceptance on the device: greedy (the longest root path whose every draft is the target's
argmax) and sampling (lossless multi-candidate speculative sampling)."""

from specgraph.kernels.accept.reference import accept_greedy_reference, accept_sampling_reference

__all__ = ["accept_greedy_reference", "accept_sampling_reference"]
