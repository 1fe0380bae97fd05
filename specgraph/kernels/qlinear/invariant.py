"""Row-invariant quantized projection: triton.py's tiles for every row count."""

from __future__ import annotations

import torch

from specgraph.kernels.qlinear.triton import project_quantized


@torch.library.custom_op("specgraph::qlinear_invariant", mutates_args=())
def qlinear_invariant(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      bias: torch.Tensor | None, format: str, group: int) -> torch.Tensor:
    """Same signature and result as qlinear_reference; each row's bits independent of the row count."""
    return project_quantized(x, weight, scales, zeros, bias, format, group)


@qlinear_invariant.register_fake
def _(x, weight, scales, zeros, bias, format, group):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
