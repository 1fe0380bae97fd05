"""A projection through a quantized weight (specgraph/quant/linear.py's layout): the reference
dequantizes and projects (reference.py); Triton tiles dequantize in their main loop, with a split of
K where rows are few, each row's bits independent of the row count (triton.py); int4 on a GPU projects up to 8
rows through torch's tinygemm kernel, over a copy of the weight in its layout (tinygemm.py)."""

from specgraph.kernels.qlinear.reference import qlinear_reference

__all__ = ["qlinear_reference"]
