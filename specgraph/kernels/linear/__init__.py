"""A projection (nn.Linear's function), with a matrix-vector kernel for one token."""

from specgraph.kernels.linear.reference import linear_reference

__all__ = ["linear_reference"]
