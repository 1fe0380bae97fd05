"""A projection (nn.Linear's function), with a matrix-vector kernel for one token and tensor-core
tiles for a few (triton.py), and tiles that give each row the same bits for any row count (invariant.py)."""

from specgraph.kernels.linear.reference import linear_reference

__all__ = ["linear_reference"]
