"""SwiGLU of the fused gate/up projection: silu(x W_gate) * (x W_up)."""

from specgraph.kernels.swiglu.reference import swiglu_reference

__all__ = ["swiglu_reference"]
