"""Projections with the elementwise op before them fused in: plain, after residual add + RMSNorm,
after SwiGLU."""

from specgraph.kernels.linear.reference import linear_reference, norm_linear_reference, swiglu_linear_reference

__all__ = ["linear_reference", "norm_linear_reference", "swiglu_linear_reference"]
