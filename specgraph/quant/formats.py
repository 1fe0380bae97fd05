"""Quantized checkpoints as people publish them, read into QuantLinear's layout (linear.py).

- compressed-tensors (`quant_method: compressed-tensors`): `pack-quantized` int4/int8 weights
  (`weight_packed` int32 words, `weight_scale` per group or channel, `weight_zero_point` packed
  along the output rows where asymmetric, `weight_shape`) and `float-quantized` fp8 weights
  (`weight` float8_e4m3fn, `weight_scale` per channel or tensor); weights only (activations unquantized);
  a `weight_g_idx` other than k // G (activation order by group) is refused.
- AutoAWQ's GEMM format (`quant_method: awq`, `version: gemm`): `qweight` int32 [K, N/8] and `qzeros`
  [K/G, N/8] packed along N in AWQ's nibble order, `scales` [K/G, N].
- GPTQ (`quant_method: gptq`, `desc_act: false`): `qweight` int32 [K/8, N] packed along K,
  `qzeros` [K/G, N/8] along N (stored less one in the original `gptq` checkpoint format, as they
  are in `gptq_v2`), `scales` [K/G, N]; a `g_idx` other than k // G (act order) is refused.
Each quantized projection's tensors become `{prefix}.weight`, `.scales`, `.zeros` (linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specgraph.errors import CheckpointError
from specgraph.quant.linear import pack, unpack

METHODS = ("compressed-tensors", "awq", "gptq")
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8 c + j of AWQ's words is in nibble AWQ_NIBBLE[j] of word c


@dataclass(frozen=True)
class Quantization:
    """What a checkpoint's quantization_config says we need to read its weights."""

    method: str  # one of METHODS
    bits: int | None = None  # awq, gptq (compressed-tensors: per projection, from its tensors)
    zeros_less_one: bool = False  # gptq's original format stores each zero point less one


def read_quantization(config, path: Path) -> Quantization | None:
    """The checkpoint's quantization (None: plain weights), refused in one line where we cannot read it."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    where = f"{path}: quantization_config"
    if method not in METHODS:
        raise CheckpointError(f"{where}: quant_method {method!r} is not supported; supported: {', '.join(METHODS)}")
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    bits = qc.get("bits", qc.get("w_bit"))
    if bits not in (4, 8) or (method == "awq" and bits != 4):
        raise CheckpointError(f"{where}: {method} with {bits} bits is not supported; supported: "
                              f"{'4' if method == 'awq' else '4 or 8'}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or qc.get("zero_point", True) is False:
            raise CheckpointError(f"{where}: AWQ version {version!r}{'' if qc.get('zero_point', True) else ' without zero points'} "
                                  "is not supported; supported: gemm with zero points")
        return Quantization("awq", 4)
    if qc.get("desc_act"):
        raise CheckpointError(f"{where}: GPTQ with desc_act (act order) is not supported; quantize with desc_act: false")
    checkpoint = qc.get("checkpoint_format", "gptq")
    if checkpoint not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"{where}: GPTQ checkpoint_format {checkpoint!r} is not supported; supported: gptq, gptq_v2")
    return Quantization("gptq", bits, zeros_less_one=checkpoint == "gptq")


def _compressed_tensors(qc: dict, where: str) -> Quantization:
    from compressed_tensors.quantization import QuantizationConfig  # (the library parses its own format)

    try:
        parsed = QuantizationConfig.model_validate(qc)
    except ValueError as exc:
        raise CheckpointError(f"{where}: not a compressed-tensors config ({str(exc).splitlines()[0]})") from None
    if parsed.quantization_status != "compressed":
        raise CheckpointError(f"{where}: quantization_status {parsed.quantization_status!r}; supported: compressed")
    for name, scheme in parsed.config_groups.items():
        weights = scheme.weights
        if scheme.input_activations is not None or scheme.output_activations is not None:
            raise CheckpointError(f"{where}: group {name} quantizes activations; supported: weight-only "
                                  "(int4/int8 pack-quantized, fp8 float-quantized)")
        if weights is None:
            continue
        kind = (weights.type, weights.num_bits, weights.strategy)
        supported = {("int", 4, "group"), ("int", 4, "channel"), ("int", 8, "group"), ("int", 8, "channel"),
                     ("float", 8, "channel"), ("float", 8, "tensor")}
        if kind not in supported:
            raise CheckpointError(f"{where}: group {name} has {weights.type}{weights.num_bits} weights by "
                                  f"{weights.strategy}; supported: int4/int8 by group or channel, fp8 by channel or tensor")
    return Quantization("compressed-tensors")


def to_quant_layout(state: dict[str, torch.Tensor], quant: Quantization, path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's state (names without `model.`) with each quantized projection's tensors in
    QuantLinear's layout; the rest as it was."""
    suffix = {"compressed-tensors": (".weight_packed", ".weight_scale"), "awq": (".qweight",), "gptq": (".qweight",)}
    out = dict(state)
    prefixes = {n.removesuffix(s) for n in state for s in suffix[quant.method] if n.endswith(s)}
    for prefix in sorted(prefixes):
        try:
            if quant.method == "compressed-tensors":
                converted = _from_compressed_tensors(out, prefix)
            else:
                converted = _from_awq_gptq(out, prefix, quant)
        except KeyError as exc:
            raise CheckpointError(f"{path}: {prefix} is not a {quant.method} quantized projection (missing "
                                  f"{prefix}.{str(exc.args[0]).rpartition('.')[2]})") from None
        except (RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {prefix} is not a {quant.method} quantized projection "
                                  f"({str(exc).splitlines()[0][:120]})") from None
        out.update({f"{prefix}.{name}": tensor for name, tensor in converted.items()})
    return out


def _from_compressed_tensors(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    scale = state.pop(f"{prefix}.weight_scale")
    if f"{prefix}.weight_packed" not in state:  # fp8: the weight itself
        if f"{prefix}.weight" not in state:
            raise KeyError("weight_packed")
        weight = state.pop(f"{prefix}.weight")
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight_scale beside a {weight.dtype} weight (fp8 weights are float8_e4m3fn)")
        n = weight.shape[0]
        if scale.numel() not in (1, n):
            raise ValueError(f"fp8 weight_scale of {scale.numel()} values for {n} rows (one per row or one)")
        return {"weight": weight.view(torch.uint8), "scales": scale.reshape(-1, 1).expand(n, 1).contiguous()}
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    words = state.pop(f"{prefix}.weight_packed")
    n, k = (int(v) for v in state.pop(f"{prefix}.weight_shape"))
    bits = words.shape[1] * 32 // k if k else 0
    if bits not in (4, 8) or words.shape != (n, -(-k * bits // 32)) or words.dtype != torch.int32:
        raise ValueError(f"weight_packed {tuple(words.shape)} {words.dtype} for a [{n}, {k}] weight")
    if scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"weight_scale {tuple(scale.shape)} for a [{n}, {k}] weight")
    _check_group_order(state.pop(f"{prefix}.weight_g_idx", None), k, scale.shape[1])
    offset = 1 << (bits - 1)  # pack-quantized stores signed values plus this
    zero_point = state.pop(f"{prefix}.weight_zero_point", None)
    if zero_point is None:
        zeros = torch.full(tuple(scale.shape), offset, dtype=torch.uint8)
    else:
        zeros = (unpack_from_int32(zero_point, bits, torch.Size(scale.shape), packed_dim=0).to(torch.int32) + offset)
    return {"weight": words, "scales": scale, "zeros": zeros.to(torch.uint8)}


def _from_awq_gptq(state: dict[str, torch.Tensor], prefix: str, quant: Quantization) -> dict[str, torch.Tensor]:
    bits, per_word = quant.bits, 32 // quant.bits
    qweight, qzeros, scales = (state.pop(f"{prefix}.{name}") for name in ("qweight", "qzeros", "scales"))
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"qweight {qweight.dtype}, qzeros {qzeros.dtype}; supported: int32 words")
    groups, n = scales.shape
    if quant.method == "awq":  # [K, N/8] along N in AWQ's order
        k = qweight.shape[0]
        q = _columns_awq(qweight, n)
        zeros = _columns_awq(qzeros, n)
    else:  # [K/8, N] along K
        k = qweight.shape[0] * per_word
        q = unpack(qweight.t(), bits, k).t()  # [K, N]
        zeros = unpack(qzeros, bits, n).to(torch.int32) + int(quant.zeros_less_one)  # [K/G, N]
        _check_group_order(state.pop(f"{prefix}.g_idx", None), k, groups)
    if q.shape != (k, n) or k % groups or zeros.shape != (groups, n):
        raise ValueError(f"qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)} disagree")
    return {"weight": pack(q.t(), bits), "scales": scales.t().contiguous(), "zeros": zeros.t().to(torch.uint8).contiguous()}


def _check_group_order(g_idx: torch.Tensor | None, k: int, groups: int) -> None:
    """A ValueError unless g_idx [K] (each input's group, where stored) is k // group_size: groups of
    inputs taken in activation order (GPTQ's act order) are not supported."""
    if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(k) // (k // groups)):
        raise ValueError("g_idx is not k // group_size (act order), which is not supported")


def _columns_awq(words: torch.Tensor, n: int) -> torch.Tensor:
    """AWQ's words [R, N/8] -> the 4-bit values [R, N] they hold, columns in order."""
    nibbles = unpack(words, 4, words.shape[1] * 8).view(words.shape[0], -1, 8)  # [R, N/8, nibble]
    return nibbles[..., list(AWQ_NIBBLE)].flatten(1)[:, :n]
