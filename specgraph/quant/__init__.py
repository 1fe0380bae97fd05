"""Quantized weights: the projections a checkpoint stores quantized (QuantLinear, linear.py), read
from the formats people publish (formats.py: compressed-tensors, AutoAWQ, GPTQ) into one layout
that the quantized projection kernels read (specgraph/kernels/qlinear)."""
