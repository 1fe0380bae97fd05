"""RMSNorm, and the residual add fused with it: x + delta, and that sum normalised, in one pass."""

from specgraph.kernels.norm.reference import add_rmsnorm_reference, rmsnorm_reference

__all__ = ["add_rmsnorm_reference", "rmsnorm_reference"]
