"""`specgraph quantize SRC -o OUT --scheme w4a16|w8a16|fp8`: a checkpoint's projections quantized by
round to nearest (per group of K, or per output row), written in compressed-tensors' format by the
compressed-tensors library itself, so that transformers and vLLM load what it writes; lm_head stays
in the checkpoint's precision. Shard by shard: round to nearest never holds more than one of the
source's shards and its compressed form (`--method awq` holds the model: it runs it). OUT appears whole or not at all
(written beside it, then renamed).
`quantize_linear`: the same quantization of one projection in memory, as a QuantLinear (what
`--widen SHAPE:SCHEME` makes of a widened model's layers as it builds them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specgraph.errors import CheckpointError, SpecgraphError
from specgraph.models.loader import TEXT_MODEL_OF, ignored_tensors, is_head, read_config, safetensor_files
from specgraph.quant.linear import QuantLinear, pack, put
from specgraph.quant.rounding import rtn_qparams, weight_args

SCHEMES = ("w4a16", "w8a16", "fp8")
DEFAULT_GROUP = {"w4a16": 128, "w8a16": None, "fp8": None}  # None: one scale per output row


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


def awq(model: torch.nn.Module, calibration: list[list[int]], args, device: torch.device | None) -> None:
    """Scale and clip `model`'s projections by AWQ (awq.py) for quantization by `args`, the
    calibration prompts' token ids run on `device` (default: the GPU if there is one); the model
    back on the CPU."""
    from tqdm import tqdm

    from specgraph.quant.awq import apply_awq

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        apply_awq(model.to(device), calibration, args, tqdm)
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
    AWQ's scales and clips (awq.py) searched on `calibration` prompts on `device` where given. Shard
    by shard, each as the source names it: round to nearest holds one shard and its compressed form
    in memory (awq, the model)."""
    from compressed_tensors.quantization import QuantizationScheme
    from transformers import AutoModelForCausalLM

    source, out = Path(source), Path(out)
    config = read_config(source)
    stored = json.loads((source / "config.json").read_text())["architectures"][0]  # (read_config's: a text model's)
    if stored in TEXT_MODEL_OF:
        raise CheckpointError(f"{source}: a {stored} (vision-language) checkpoint, which quantize does not read yet; "
                              f"quantize its text model's checkpoint ({TEXT_MODEL_OF[stored]})")
    if is_head(config) or getattr(config, "quantization_config", None) is not None:
        raise CheckpointError(f"{source}: {'an EAGLE-3 head' if is_head(config) else 'already quantized'}; quantize "
                              "a model's checkpoint in full precision")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecgraphError(f"-o: {out} exists and is not an empty folder; give a new folder")
    if scheme == "fp8" and group is not None:
        raise SpecgraphError("--group-size: fp8 weights are scaled per output row; leave --group-size out")
    group = group if group is not None else DEFAULT_GROUP[scheme]
    files = safetensor_files(source)
    if calibration is not None:  # (tokenized before the model loads: a tokenizer's errors come first)
        from specgraph.text import Tokenizer

        tokenizer = Tokenizer(source)
        calibration = [tokenizer.encode(text) for text in calibration]
        if not any(calibration):
            raise SpecgraphError("--calibration: its prompts encode to no tokens; give prompts with text")
    if calibration is None:
        with torch.device("meta"):  # the modules' names and shapes, no weights
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype="auto", trust_remote_code=False)
        except (SafetensorError, OSError, ValueError) as exc:  # truncated, foreign, unreadable
            raise CheckpointError(f"{source}: transformers cannot load it ({str(exc).splitlines()[0][:160]})") from None
    projections = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    if group:
        odd = next((name for name, m in projections.items() if m.in_features % group), None)
        if odd is not None:
            raise SpecgraphError(f"--group-size: {group} does not divide the {projections[odd].in_features} inputs of "
                                 f"{odd}; give a group size that divides every projection's inputs (e.g. 32)")
    quantization = QuantizationScheme(targets=["Linear"], weights=weight_args(scheme, group))
    if calibration is not None:
        awq(model, calibration, quantization.weights, device)
    staging = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        write_quantized(source, files, staging, set(projections), quantization,
                        None if calibration is None else model.state_dict(), ignored_tensors(config))
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, (OSError, SafetensorError)):  # (disk full, no permission; reads raise CheckpointErrors)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0][:160]
            raise SpecgraphError(f"-o: cannot write {out}: {reason}") from None
        raise
    return out


def write_quantized(source: Path, files: list[Path], folder: Path, projections: set[str], quantization,
                    state: dict[str, torch.Tensor] | None, ignored: re.Pattern) -> None:
    """Write into `folder` the checkpoint at `source` (its safetensors `files`) with the weights of
    the modules named in `projections` compressed by compressed-tensors for `quantization` (a
    QuantizationScheme), each tensor taken from `state` where given (a model's, changed in memory),
    else from its file; the tensors `ignored` names (that transformers does not build, as Qwen3.5's
    mtp.*) from the file and left as they are (the quantization_config says so); the config with
    its quantization_config, and the source's other files."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import save_file
    from tqdm import tqdm

    quantization.format = infer_module_format(torch.nn.Linear, quantization)
    compressor = BaseCompressor.get_value_from_registry(quantization.format.value)
    weight_map, done, kept_as_stored = {}, set(), False  # tensor name -> its shard; the projections written
    kind = f"{quantization.weights.type}{quantization.weights.num_bits}"  # int4, int8, float8
    with tqdm(total=len(projections), desc=f"quantize {kind}", unit="projection") as bar:
        for file in files:
            try:
                with safe_open(file, "pt") as stored:
                    shard = {key: state[key] if state is not None and key in state else stored.get_tensor(key)
                             for key in stored.keys()}
            except (SafetensorError, OSError) as exc:  # truncated, foreign, unreadable
                raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
            tensors = {}
            for key, tensor in shard.items():
                if ignored.match(key):
                    kept_as_stored = True
                elif state is not None and key not in state:
                    raise CheckpointError(f"{file}: tensor {key} is not a weight of the model transformers builds "
                                          "from its config; quantize reads checkpoints with transformers' own names")
                name = key.removesuffix(".weight")
                if key.endswith(".weight") and name in projections:
                    scale, zero = rtn_qparams(tensor, quantization.weights)
                    compressed = compressor.compress({"weight": tensor, "weight_scale": scale.to(tensor.dtype),
                                                      "weight_zero_point": zero}, quantization)
                    tensors.update({f"{name}.{part}": value for part, value in compressed.items()})
                    done.add(name)
                    bar.update()
                else:
                    tensors[key] = tensor
            save_file(tensors, folder / file.name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file.name))
    if done != projections:
        missing = sorted(projections - done)[0]
        raise CheckpointError(f"{source}: no weight for {missing}, a projection of the model its config describes; "
                              "quantize reads checkpoints with transformers' own names")
    if len(files) > 1 or (source / "model.safetensors.index.json").is_file():  # (as the source: its names)
        size = sum((folder / file.name).stat().st_size for file in files)
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for file in source.iterdir():  # the config, tokenizer, generation settings, chat template, ...
        if file.is_file() and file.suffix in (".json", ".txt", ".jinja", ".model", ".tiktoken", ".md") and (
                file.name != "model.safetensors.index.json"):
            shutil.copy(file, folder / file.name)
    ignore = ["lm_head"] + ([f"re:{ignored.pattern}"] if kept_as_stored else [])  # (compressed-tensors' regex form)
    ModelCompressor(QuantizationConfig(config_groups={"group_0": quantization}, ignore=ignore,
                                       format=quantization.format.value, quantization_status="compressed")
                    ).update_config(str(folder))
