"""Round to nearest as compressed-tensors defines it: the QuantizationArgs of each scheme's weights,
the scales and zero points of a weight's groups, and a weight quantized and back (what AWQ's
searches measure)."""

from __future__ import annotations

import torch


def weight_args(scheme: str, group: int | None):
    """compressed-tensors' QuantizationArgs of `scheme`'s weights (symmetric; group None: per channel)."""
    from compressed_tensors.quantization import QuantizationArgs

    if scheme == "fp8":
        return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "channel"}
    return QuantizationArgs(num_bits=4 if scheme == "w4a16" else 8, type="int", symmetric=True, **strategy)


def rtn_qparams(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest scales and zero points [N, groups] (groups 1 per channel) of weight [N, K]
    over each group's range, by compressed-tensors' own rule."""
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.view(weight.shape[0], -1, args.group_size) if args.group_size else weight[:, None]  # [N, groups, G]
    return calculate_qparams(w.amin(-1), w.amax(-1), args)


def fake_quantized(weight: torch.Tensor, args) -> torch.Tensor:
    """weight [N, K] quantized by compressed-tensors' round to nearest and back (float32)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    scale, zero = rtn_qparams(weight, args)
    return fake_quantize(weight, scale, zero, args).float()
