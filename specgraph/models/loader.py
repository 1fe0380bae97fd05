"""Read Hugging Face checkpoint folders: config.json + safetensors (sharded or not).

Pickle checkpoints (*.bin, *.pt) are never loaded and remote code is never run.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from specgraph.errors import CheckpointError
from specgraph.models import eagle
from specgraph.models.eagle import Eagle3Head, HeadShape
from specgraph.models.hybrid import HybridModel, HybridShape, from_hf_norms
from specgraph.models.llama import LlamaModel, LlamaShape, fuse_hf_state
from specgraph.quant.formats import read_quantization, to_quant_layout
from specgraph.quant.linear import FORMATS, QuantLinear, put

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
HYBRID = ("Qwen3_5ForCausalLM",)
HEADS = (eagle.ARCHITECTURE,)  # draft heads over a target's features (models/eagle.py)
TEXT_MODEL_OF = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM"}  # vision-language checkpoints: their text model
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + HYBRID + HEADS + tuple(TEXT_MODEL_OF)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(path: Path) -> PretrainedConfig:
    """The checkpoint's config, after checking that it describes a model we can run (its weights are
    checked when they are loaded: a compiled program's folder holds configs without them)."""
    path = Path(path)
    if path.is_file():
        raise CheckpointError(f"{path} is a file; a checkpoint is a folder (config.json + *.safetensors)")
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint folder does not exist")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (a Hugging Face checkpoint folder has config.json + *.safetensors)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{path}/config.json: cannot be read ({str(exc).splitlines()[0]})") from None
    arch = (getattr(config, "architectures", None) or ["?"])[0]
    if arch in eagle.OLDER:
        raise CheckpointError(f"{path}: {arch} is an EAGLE-1/2 head, which is not supported; supported heads: "
                              f"{', '.join(HEADS)} (EAGLE-3)")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported architecture {arch}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch in TEXT_MODEL_OF:  # (the vision tower is never loaded; the top level says what ties and what is quantized)
        text = config.get_text_config()
        config = type(text).from_dict({**text.to_dict(), "architectures": [TEXT_MODEL_OF[arch]],
                                       "tie_word_embeddings": config.tie_word_embeddings,
                                       **{k: v for k, v in config.to_dict().items() if k == "quantization_config"}})
    return config


def our_name(name: str) -> str:
    """A checkpoint tensor's name in our modules: without the model. prefix (or a vision-language
    checkpoint's model.language_model.)."""
    return name.removeprefix("model.language_model.").removeprefix("model.")


def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index}: not a safetensors index (JSON with a 'weight_map' of shard files)") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard {missing[0]} named in model.safetensors.index.json is missing")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {pickles[0]}: pickle checkpoints are never loaded; convert it to safetensors)" if pickles else ""
        raise CheckpointError(f"{path}: no *.safetensors weights{hint}")
    return files


@dataclass(frozen=True)
class TokenizerFiles:
    """What a checkpoint's tokenizer files say: `fingerprint`, a hash of what the tokenizer maps
    (tokenizer.json's model — vocabulary and merges — and its added tokens, parsed, so that a
    re-indented file is the same tokenizer; other tokenizer files by their bytes), and `size`, the
    token ids it can produce (tokenizer.json's highest id + 1; None without one)."""

    fingerprint: str
    size: int | None

    def __str__(self) -> str:
        return f"{self.size or 'unknown'} tokens, fingerprint {self.fingerprint[:12]}"


def read_tokenizer(path: Path) -> TokenizerFiles | None:
    """The tokenizer files of checkpoint folder `path`, or None where it carries none."""
    digest = hashlib.sha256()
    found, size = False, None
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model"):
        file = path / name
        if not file.is_file():
            continue
        found = True
        if name == "tokenizer.json":
            try:
                spec = json.loads(file.read_text(encoding="utf-8"))
                mapping = {"model": spec["model"], "added_tokens": spec.get("added_tokens")}
                vocab = spec["model"].get("vocab") or {}
                ids = list(vocab.values()) if isinstance(vocab, dict) else range(len(vocab))  # (a list: Unigram's)
                ids = [*ids, *(token["id"] for token in spec.get("added_tokens") or [])]
                size = max(ids) + 1 if ids else None
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                raise CheckpointError(f"{file}: not a tokenizer (JSON with a 'model')") from None
            digest.update(name.encode() + json.dumps(mapping, sort_keys=True).encode())
        else:
            digest.update(name.encode() + file.read_bytes())
    return TokenizerFiles(digest.hexdigest(), size) if found else None


def llama_shape(config: PretrainedConfig) -> LlamaShape:
    arch = config.architectures[0]
    attention_bias = bool(getattr(config, "attention_bias", False))
    return LlamaShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias=True if arch == "Qwen2ForCausalLM" else attention_bias,
        o_bias=False if arch == "Qwen2ForCausalLM" else attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
    )


def hybrid_shape(config: PretrainedConfig) -> HybridShape:
    rotary = int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))
    return HybridShape(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        layer_types=tuple(config.layer_types),
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rotary_dim=rotary,
        linear_key_heads=config.linear_num_key_heads,
        linear_value_heads=config.linear_num_value_heads,
        linear_key_dim=config.linear_key_head_dim,
        linear_value_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        rms_norm_eps=config.rms_norm_eps,
    )


def head_shape(config: PretrainedConfig, path: Path) -> HeadShape:
    """An EAGLE-3 head's shape from its config (one decoder layer; `draft_vocab_size` and
    `target_hidden_size` default to the vocabulary and the width, as published heads leave them)."""
    if config.num_hidden_layers != 1:
        raise CheckpointError(f"{path}: an EAGLE-3 head has one decoder layer (config.json num_hidden_layers: "
                              f"{config.num_hidden_layers})")
    features = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if features is not None and (len(features) != 3 or not all(isinstance(i, int) and i >= 0 for i in features)):
        raise CheckpointError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids must name three target layers "
                              f"(got {features!r})")
    return HeadShape(llama_shape(config), getattr(config, "target_hidden_size", None) or config.hidden_size,
                     getattr(config, "draft_vocab_size", None) or config.vocab_size,
                     tuple(features) if features is not None else None)


def is_head(config: PretrainedConfig) -> bool:
    return config.architectures[0] in HEADS


def is_hybrid(config: PretrainedConfig) -> bool:
    return config.architectures[0] in HYBRID


def model_shape(config: PretrainedConfig) -> LlamaShape | HybridShape:
    return hybrid_shape(config) if is_hybrid(config) else llama_shape(config)


def rope_tables(config: PretrainedConfig, head_dim: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [K/2] and cos/sin scale for the checkpoint's rope type."""
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq.to(device), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise CheckpointError(f"rope_type {rope_type!r} is not supported; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return inv_freq, float(scale)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[name]


def ignored_tensors(config: PretrainedConfig) -> re.Pattern:
    """The names of the tensors that transformers' own class for the architecture (a text model's)
    ignores in a checkpoint (Qwen3.5's multi-token-prediction mtp.* and vision tower model.visual.*)."""
    import transformers

    patterns = getattr(getattr(transformers, config.architectures[0], None), "_keys_to_ignore_on_load_unexpected", None)
    return re.compile("|".join(f"(?:{p})" for p in patterns or ["(?!)"]))


def load_model(path: Path, dtype: torch.dtype, device: torch.device | str) -> LlamaModel | HybridModel | Eagle3Head:
    """Build our module for the checkpoint at `path` and load its safetensors weights onto `device`."""
    path, device = Path(path), torch.device(device)
    config = read_config(path)
    quantization = read_quantization(config, path)
    hybrid, head = is_hybrid(config), is_head(config)
    with torch.device("meta"):
        if head:
            model = Eagle3Head(head_shape(config, path))
        else:
            model = HybridModel(hybrid_shape(config)) if hybrid else LlamaModel(llama_shape(config))
    model.to_empty(device=device)
    state, ignored = {}, ignored_tensors(config)
    for file in safetensor_files(path):
        try:
            weights = load_file(file, device=str(device))
        except (SafetensorError, OSError, ValueError) as exc:  # truncated, foreign, unreadable
            raise CheckpointError(f"{file}: not a readable safetensors file ({str(exc).splitlines()[0][:120]})") from None
        for name, tensor in weights.items():
            if not ignored.match(name):
                state[our_name(name)] = tensor
    if hybrid:
        state = from_hf_norms(state)
    if head:
        state = _head_state(eagle.from_published(state), model, path)
    if quantization is not None:
        state = to_quant_layout(state, quantization, path)
    state = {name: tensor.to(dtype) if tensor.is_floating_point() and not name.endswith(".scales") else tensor
             for name, tensor in state.items()}  # (quantization scales keep the checkpoint's precision)
    if "lm_head.weight" not in state and getattr(config, "tie_word_embeddings", False) and not head:
        state["lm_head.weight"] = state.get("embed_tokens.weight")
    state = fuse_hf_state(_same_quantization(state, model.FUSED, path), model.FUSED)
    if quantization is not None:
        _quantize_projections(model, state, path)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise CheckpointError(f"{path}: weights do not match the {config.architectures[0]} layout ({what})")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:  # a tensor of another shape than config.json says
        raise CheckpointError(f"{path}: weights do not match config.json ({str(exc).splitlines()[-1].strip()[:160]})") from None
    if getattr(config, "tie_word_embeddings", False) and not head and not isinstance(model.lm_head, QuantLinear):
        model.lm_head.weight = model.embed_tokens.weight
    rotary = model.shape.rotary_dim if hybrid else model.shape.head_dim
    model.inv_freq, model.rope_scale = rope_tables(config, rotary, device)
    scales = {m: m.scales for m in model.modules() if isinstance(m, QuantLinear)}
    model.to(dtype)
    for module, kept in scales.items():  # (in the checkpoint's precision, which model.to would round)
        module.scales = kept
    model.inv_freq = model.inv_freq.float()
    return model.eval().requires_grad_(False)


def _same_quantization(state: dict[str, torch.Tensor], fused_names: dict[str, tuple[str, ...]], path: Path
                       ) -> dict[str, torch.Tensor]:
    """`state`, after checking that the parts of each projection we fuse are stored alike (all
    quantized in one format and group, or none)."""
    for parts in fused_names.values():
        for name in [n for n in state if n.endswith(f".{parts[0]}.weight")]:
            stems = [name.removesuffix(".weight").replace(parts[0], part) for part in parts]
            kinds = {(state[f"{s}.weight"].dtype, state[f"{s}.weight"].shape[1:],
                      state[f"{s}.scales"].shape[1:] if f"{s}.scales" in state else None)
                     for s in stems if f"{s}.weight" in state}  # (words per row: int4 and int8 both pack int32)
            if len(kinds) > 1:
                raise CheckpointError(f"{path}: {', '.join(stems)} are stored differently (quantized in different "
                                      "formats or groups, or some not); we fuse them, so they must be stored alike")
    return state


def _quantize_projections(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Make each projection whose weight `state` holds quantized (QuantLinear's layout) a QuantLinear."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or f"{name}.scales" not in state:
            continue
        weight, scales, k = state[f"{name}.weight"], state[f"{name}.scales"], module.in_features
        if weight.dtype == torch.uint8:
            format, group = "fp8", k
        else:
            bits = weight.shape[1] * 32 // k
            format, group = next((f for f, b in FORMATS.items() if b == bits and f != "fp8"), None), k // scales.shape[1]
            if format is None:
                raise CheckpointError(f"{path}: {name} packs {bits}-bit weights; supported: 4 or 8 bits")
        put(model, name, QuantLinear(k, module.out_features, module.bias is not None, format, group,
                                     scales.dtype).to(weight.device))


def load_embedding(path: Path) -> torch.Tensor:
    """The token embedding [V, H] of the checkpoint at `path` alone (what a head that shares its
    target's reads, in a process without the target)."""
    for file in safetensor_files(Path(path)):
        try:
            with safe_open(file, framework="pt") as f:
                name = next((n for n in f.keys() if our_name(n) == "embed_tokens.weight"), None)
                if name is not None:
                    return f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({str(exc).splitlines()[0][:120]})") from None
    raise CheckpointError(f"{path}: no embed_tokens.weight in its safetensors files")


def _head_state(state: dict[str, torch.Tensor], model: Eagle3Head, path: Path) -> dict[str, torch.Tensor]:
    """A head's published state made whole: without embed_tokens it shares the target's (a
    placeholder until the lowering ties it), without d2t its ids are the target's, without t2d
    it is d2t's image; d2t must map into the target's vocabulary."""
    shape = model.head
    vocab, draft_vocab = shape.layer.vocab_size, shape.draft_vocab_size
    state = dict(state)
    model.shares_embedding = "embed_tokens.weight" not in state
    if model.shares_embedding:
        state["embed_tokens.weight"] = torch.zeros(vocab, shape.layer.hidden_size)
    if "d2t" not in state:
        if draft_vocab != vocab:
            raise CheckpointError(f"{path}: no d2t, which a head whose draft_vocab_size ({draft_vocab}) differs from "
                                  f"its vocab_size ({vocab}) needs to map its ids to the target's")
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    d2t = state["d2t"]
    if d2t.shape != (draft_vocab,) or d2t.is_floating_point():
        raise CheckpointError(f"{path}: d2t must be {draft_vocab} integers (draft_vocab_size), got {d2t.dtype} "
                              f"{list(d2t.shape)}")
    ids = torch.arange(draft_vocab) + d2t.long().cpu()
    if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != draft_vocab:
        raise CheckpointError(f"{path}: d2t maps draft ids outside the target's vocabulary (0..{vocab - 1}) or two "
                              "onto one target id")
    state["d2t"] = d2t.long()
    if "t2d" not in state:
        state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    return state
