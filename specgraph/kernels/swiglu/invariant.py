"""Row-invariant SwiGLU: the gate/up projection by the row-invariant projection (see
kernels/linear/invariant.py), then one elementwise pass; each row's bits independent of the row count."""

from __future__ import annotations

import torch

from specgraph.kernels.linear.invariant import project_rows
from specgraph.kernels.swiglu.triton import silu_mul_rows


@torch.library.custom_op("specgraph::swiglu_invariant", mutates_args=())
def swiglu_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Same signature and result as swiglu_reference."""
    return silu_mul_rows(project_rows(x, weight, bias))


@swiglu_invariant.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)
