"""Reference projection: F.linear, and oneDNN's on the CPU where nothing traces it and no gradient is
wanted (the same fp32 products, summed in another order). PyTorch's CPU builds send F.linear to MKL's
sgemm, which on the AMD EPYC CPU this project's CI runs on takes 1.4-2.2x oneDNN's time at 4-256 rows
of a [3072, 384] weight (204 against 144 us at 4 rows): most of a decoding step on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ONEDNN = torch.backends.mkldnn.is_available()


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K]; weight [N, K] (as nn.Linear keeps it) -> [..., N]."""
    if (ONEDNN and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):  # (Inductor cannot lower oneDNN's op at symbolic shapes)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
