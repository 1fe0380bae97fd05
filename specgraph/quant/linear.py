"""QuantLinear: a projection (nn.Linear's function) whose weight [N, K] is kept quantized.

One layout for every format we read (formats.py converts to it):
- int4 / int8: `weight` int32 [N, K bits / 32], element k of row n unsigned in bits
  (k % (32 / bits)) * bits of word k // (32 / bits) (compressed-tensors' pack-quantized words, its
  +2^(bits-1) offset undone into the zero points); `scales` [N, K / group] and `zeros` uint8
  [N, K / group]: w[n, k] = (q[n, k] - zeros[n, k // group]) * scales[n, k // group].
- fp8: `weight` uint8 [N, K], the bits of float8_e4m3fn values (bytes, so that casting the model to
  its dtype leaves them), `scales` [N, 1]: w[n, k] = weight[n, k] * scales[n]; no zeros.
Scales keep the precision the checkpoint gave them (the loader does not round them to the model's dtype).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

FORMATS = {"int4": 4, "int8": 8, "fp8": 8}  # format -> bits per weight


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, format: str, group: int,
                 scale_dtype: torch.dtype = torch.float32):
        """`group`: weights per scale along K (in_features for one scale per row)."""
        super().__init__()
        if format not in FORMATS:
            raise ValueError(f"quantized format {format!r}: supported {', '.join(FORMATS)}")
        if in_features % group:
            raise ValueError(f"a group of {group} does not divide {in_features} input features")
        self.in_features, self.out_features, self.format, self.group = in_features, out_features, format, group
        if format == "fp8":
            self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.uint8))
            self.register_buffer("scales", torch.empty(out_features, 1, dtype=scale_dtype))
            self.zeros = None
        else:
            per_word = 32 // FORMATS[format]
            self.register_buffer("weight", torch.empty(out_features, -(-in_features // per_word), dtype=torch.int32))
            self.register_buffer("scales", torch.empty(out_features, in_features // group, dtype=scale_dtype))
            self.register_buffer("zeros", torch.empty(out_features, in_features // group, dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # int4 on a GPU: the weight again in the layout of torch's tinygemm kernel, for a few rows
        # (kernels/qlinear/tinygemm.py), not saved
        self.register_buffer("tinygemm_weight", None, persistent=False)
        self.register_buffer("tinygemm_scales", None, persistent=False)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.format}, group {self.group}"

    @property
    def bytes(self) -> int:
        """Bytes a forward reads of this projection's weight (packed values, scales, zeros)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales, self.zeros) if t is not None)


def put(root: nn.Module, name: str, module: nn.Module) -> None:
    """Make `module` the submodule `name` (dotted) of `root`, in place of the one there."""
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent), leaf, module)


def unpack(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """int32 words [N, W] -> the unsigned values [N, k] they pack (QuantLinear's layout), uint8."""
    assert bits in (4, 8) and sys.byteorder == "little", (bits, sys.byteorder)
    if words.stride(-1) != 1:  # (contiguous() keeps a transposed [N, 1]'s strides: it counts as contiguous)
        words = words.clone(memory_format=torch.contiguous_format)
    data = words.view(torch.uint8)  # [N, 4W]: each word's bytes, its low bits first
    if bits == 4:
        data = torch.stack((data & 15, data >> 4), dim=-1).flatten(-2)  # [N, 8W]
    return data[..., :k]


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [N, K] (< 2^bits) -> int32 words [N, ceil(K bits / 32)] (QuantLinear's layout)."""
    per_word = 32 // bits
    n, k = values.shape
    padded = torch.nn.functional.pad(values.to(torch.int64), (0, -k % per_word)).view(n, -1, per_word)
    shifts = torch.arange(per_word, device=values.device) * bits
    words = (padded << shifts).sum(-1)  # < 2^32: each value in its own bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, format: str, group: int,
               k: int, dtype: torch.dtype) -> torch.Tensor:
    """QuantLinear's stored weight -> the weight [N, K] it stands for, computed in `dtype` (the
    projection's compute dtype) or the scales' where they are more precise: an fp32 model's bf16
    scales are widened exactly and multiplied in fp32, as transformers does; a bf16 model's fp32
    scales are not rounded first, as the Triton kernel does."""
    dtype = torch.promote_types(dtype, scales.dtype)
    scales = scales.to(dtype)
    if format == "fp8":
        return weight.view(torch.float8_e4m3fn).to(dtype) * scales
    n = weight.shape[0]
    q = unpack(weight, FORMATS[format], k).view(n, -1, group).to(dtype)  # [N, K/G, G]: integers, exact
    return ((q - zeros[..., None].to(dtype)) * scales[..., None]).view(n, k)


def weights_of(model: nn.Module) -> str:
    """How `model`'s weights are stored, for reports: its dtype, and its quantized projections' formats."""
    dtype = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    kinds = sorted({f"{m.format} group {m.group}" for m in model.modules() if isinstance(m, QuantLinear)})
    return f"{', '.join(kinds)} projections, {dtype} otherwise" if kinds else dtype
