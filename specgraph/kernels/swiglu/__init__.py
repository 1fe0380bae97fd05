"""SwiGLU over the fused gate/up projection: silu(gate) * up."""

from specgraph.kernels.swiglu.reference import swiglu_reference

__all__ = ["swiglu_reference"]
