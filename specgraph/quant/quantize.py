"""`specgraph quantize SRC -o OUT --scheme w4a16|w8a16|fp8`: a checkpoint's projections quantized by
round to nearest (per group of K, or per output row), written in compressed-tensors' format by the
compressed-tensors library itself, so that transformers and vLLM load what it writes; lm_head stays
in the checkpoint's precision. OUT appears whole or not at all (written beside it, then renamed).
`quantize_linear`: the same quantization of one projection in memory, as a QuantLinear (what
`--widen SHAPE:SCHEME` makes of a widened model's layers as it builds them)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from specgraph.errors import CheckpointError, SpecgraphError
from specgraph.models.loader import is_head, read_config
from specgraph.quant.linear import QuantLinear, pack, put

SCHEMES = ("w4a16", "w8a16", "fp8")
DEFAULT_GROUP = {"w4a16": 128, "w8a16": None, "fp8": None}  # None: one scale per output row


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


@torch.no_grad()
def quantize_linear(linear: torch.nn.Linear, scheme: str, group: int | None = None) -> QuantLinear:
    """`linear` quantized as `specgraph quantize --scheme scheme` quantizes it, in QuantLinear's layout
    (scales in the weight's dtype, on its device)."""
    from compressed_tensors.quantization.lifecycle.forward import quantize

    group = group if group is not None else DEFAULT_GROUP[scheme]
    args = weight_args(scheme, group)
    weight = linear.weight
    n, k = weight.shape
    scale, zero = rtn_qparams(weight, args)
    format = "fp8" if scheme == "fp8" else f"int{args.num_bits}"
    out = QuantLinear(k, n, linear.bias is not None, format, group or k, weight.dtype).to(weight.device)
    out.scales.copy_(scale.reshape(out.scales.shape))
    if scheme == "fp8":
        out.weight.copy_(quantize(weight, scale, zero, args, dtype=torch.float8_e4m3fn).view(torch.uint8))
    else:
        offset = 1 << (args.num_bits - 1)  # signed codes to QuantLinear's unsigned ones
        codes = quantize(weight, scale, zero, args, dtype=torch.int8).to(torch.int32) + offset
        out.weight.copy_(pack(codes, args.num_bits))
        out.zeros.copy_((zero.reshape(out.zeros.shape).to(torch.int32) + offset).to(torch.uint8))
    if linear.bias is not None:
        out.bias.copy_(linear.bias)
    return out


def quantize_projections(module: torch.nn.Module, scheme: str, group: int | None = None) -> None:
    """Replace every nn.Linear inside `module` by its quantize_linear."""
    for name, child in list(module.named_modules()):
        if isinstance(child, torch.nn.Linear):
            put(module, name, quantize_linear(child, scheme, group))


def awq(model: torch.nn.Module, source: Path, calibration: list[str], args, device: torch.device | None) -> None:
    """Scale and clip `model`'s projections by AWQ (awq.py) for quantization by `args`, the
    calibration run on `device` (default: the GPU if there is one); the model back on the CPU."""
    from tqdm import tqdm

    from specgraph.quant.awq import apply_awq
    from specgraph.text import Tokenizer

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = Tokenizer(source)
    try:
        apply_awq(model.to(device), [tokenizer.encode(text) for text in calibration], args, tqdm)
    except NotImplementedError as exc:
        raise SpecgraphError(f"{exc}; awq knows Llama and Qwen3.5 decoder layers (use --method rtn)") from None
    except torch.OutOfMemoryError:
        raise SpecgraphError(f"--device: the model and its calibration do not fit in {device}'s memory; give a "
                             "larger device or fewer calibration prompts") from None
    finally:
        model.to("cpu")


def quantize_checkpoint(source: Path, out: Path, scheme: str, group: int | None = None,
                        calibration: list[str] | None = None, device: torch.device | None = None) -> Path:
    """Quantize the checkpoint at `source` into the new folder `out` -> out: round to nearest, after
    AWQ's scales and clips (awq.py) searched on `calibration` prompts on `device` where given."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    source, out = Path(source), Path(out)
    config = read_config(source)
    if is_head(config) or getattr(config, "quantization_config", None) is not None:
        raise CheckpointError(f"{source}: {'an EAGLE-3 head' if is_head(config) else 'already quantized'}; quantize "
                              "a model's checkpoint in full precision")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecgraphError(f"-o: {out} exists and is not an empty folder; give a new folder")
    if scheme == "fp8" and group is not None:
        raise SpecgraphError("--group-size: fp8 weights are scaled per output row; leave --group-size out")
    group = group if group is not None else DEFAULT_GROUP[scheme]
    model = AutoModelForCausalLM.from_pretrained(source, dtype="auto", trust_remote_code=False)
    projections = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    if group:
        odd = next((name for name, m in projections.items() if m.in_features % group), None)
        if odd is not None:
            raise SpecgraphError(f"--group-size: {group} does not divide the {projections[odd].in_features} inputs of "
                                 f"{odd}; give a group size that divides every projection's inputs (e.g. 32)")
    args = weight_args(scheme, group)
    if calibration is not None:
        awq(model, source, calibration, args, device)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    with torch.no_grad():
        for name, module in tqdm(projections.items(), desc=f"quantize {scheme}", unit="projection"):
            scale, zero = rtn_qparams(module.weight, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        compressor.update_config(str(staging))
        for file in source.iterdir():
            if file.name.startswith("tokenizer") or file.name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
                shutil.copy(file, staging / file.name)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out
