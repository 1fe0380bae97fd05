"""The keyed Gumbel-max over the vocabulary: each row's k best tokens by logits / temperature
(filtered) plus the noise g(seed, position, token) of draws.py."""

from specgraph.kernels.gumbel.reference import perturbed_top_reference

__all__ = ["perturbed_top_reference"]
