"""Widen a small trained model into a model of a real model's shape that computes the same function.

Trained weights go into the leading rows/columns and every other weight is zero: extra attention
heads get zero query/key/value rows and zero output columns, extra MLP units zero rows and columns,
extra layers zero output projections (o_proj, down_proj) so they pass the residual through, extra
vocabulary rows zero (and are never served: `served_vocab` keeps the logits to the trained ids).
Hidden-size RMSNorm weights scale by sqrt(small/big) and eps by small/big, which cancels the larger
mean denominator. Head dimensions stay, so softmax scale, rotary dims and per-head norms are
unchanged. Every byte is still read and every product computed: time and memory are the real
shape's, predictions (and so acceptance) are the trained model's.

The hybrid (Qwen3.5) fixture widens the same way: extra DeltaNet key/value heads get zero
projection rows (their keys are zero, so they never write their state) and zero output columns,
and extra layers follow the real layer pattern with zero output projections. Keeping the fixture's
head dims (attention 128, DeltaNet 64), a shape has twice the real model's heads of half the width:
the same weight and KV bytes, half the DeltaNet state.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from specgraph.errors import SpecgraphError
from specgraph.models.eagle import Eagle3Head, HeadShape
from specgraph.models.hybrid import FULL, LINEAR, HybridModel, HybridShape
from specgraph.models.llama import LlamaModel, LlamaShape, qkv_sizes
from specgraph.parallel import shard_layer, sharded_shape
from specgraph.quant.linear import QuantLinear
from specgraph.quant.quantize import quantize_projections


def _qwen35(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, key_heads: int,
            value_heads: int, linear_dim: int) -> HybridShape:
    """A Qwen3.5 text shape: three DeltaNet layers, then one full-attention layer, repeated."""
    return HybridShape(248320, hidden, intermediate, (LINEAR, LINEAR, LINEAR, FULL) * (layers // 4), heads, kv_heads,
                       head_dim, head_dim // 4, key_heads, value_heads, linear_dim, linear_dim, 4, 1e-6)


# The published Qwen3.5 text configs; their parameter counts are the references of the widened shapes.
QWEN35_REAL = {"qwen3.5-9b": _qwen35(4096, 12288, 32, 16, 4, 256, 16, 32, 128),
               "qwen3.5-27b": _qwen35(5120, 17408, 64, 24, 4, 256, 16, 48, 128)}

# name -> (shape with the small model's norm eps filled in by `widen`, tied embeddings, real parameter count)
SHAPES: dict[str, tuple[LlamaShape | HybridShape, bool, int]] = {
    "llama-3.2-1b": (LlamaShape(128256, 2048, 8192, 16, 32, 8, 64, 1e-5), True, 1_235_814_400),
    "llama-3.2-3b": (LlamaShape(128256, 3072, 8192, 28, 24, 8, 128, 1e-5), True, 3_212_749_824),
    "llama-3-8b": (LlamaShape(128256, 4096, 14336, 32, 32, 8, 128, 1e-5), False, 8_030_261_248),
    "llama-3-70b": (LlamaShape(128256, 8192, 28672, 80, 64, 8, 128, 1e-5), False, 70_553_706_496),
    # the hybrid fixture's head dims: twice the heads of half the width
    "qwen3.5-9b": (_qwen35(4096, 12288, 32, 32, 8, 128, 32, 64, 64), False,
                   QWEN35_REAL["qwen3.5-9b"].parameter_count(tied=False)),
    "qwen3.5-27b": (_qwen35(5120, 17408, 64, 48, 8, 128, 32, 96, 64), False,
                    QWEN35_REAL["qwen3.5-27b"].parameter_count(tied=False)),
}
DRAFT_SHAPES = ("llama-3.2-1b", "llama-3.2-3b")  # drafters widen to the small shape with their head dim
HEAD_DRAFT_VOCAB = 32000  # an EAGLE-3 head widens to its target's shape and the published heads' draft vocabulary


def draft_shape_for(small: LlamaShape) -> str:
    for name in DRAFT_SHAPES:
        if SHAPES[name][0].head_dim == small.head_dim:
            return name
    raise SpecgraphError(f"no draft shape has head_dim {small.head_dim}; shapes: {', '.join(DRAFT_SHAPES)}")


GROWS = {LlamaShape: ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"),
         HybridShape: ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                       "linear_key_heads", "linear_value_heads")}
KEEPS = {LlamaShape: ("head_dim",), HybridShape: ("head_dim", "linear_key_dim", "linear_value_dim", "conv_kernel")}


def misfits(small: LlamaShape | HybridShape, big: LlamaShape | HybridShape) -> list[str]:
    """Why the function of a model of shape `small` cannot be computed at shape `big` ([] if it can)."""
    kind = type(small)
    if type(big) is not kind:
        return [f"a {type(big).__name__} does not fit a {kind.__name__[:-5]} model"]
    problems = [f"{field} {getattr(small, field)} > {getattr(big, field)}" for field in GROWS[kind]
                if getattr(small, field) > getattr(big, field)]
    problems += [f"{field} {getattr(small, field)} != {getattr(big, field)}" for field in KEEPS[kind]
                 if getattr(small, field) != getattr(big, field)]
    if small.num_heads // small.num_kv_heads > big.num_heads // big.num_kv_heads:
        problems.append("query heads per kv head exceed the shape's")
    if kind is HybridShape:
        if small.linear_value_heads // small.linear_key_heads > big.linear_value_heads // big.linear_key_heads:
            problems.append("DeltaNet value heads per key head exceed the shape's")
        if big.layer_types[: small.num_layers] != small.layer_types:
            problems.append("the layer pattern differs")
    return problems


def widened_shape(small: LlamaShape | HybridShape, name: str | LlamaShape | HybridShape,
                  tied: bool = False, what: str = "the model") -> tuple[LlamaShape | HybridShape, bool]:
    """The shape `name` (a SHAPES key, or a shape with `tied`) with the small model's norm eps and
    flags; `what`: the model, for errors (e.g. "stage target's model")."""
    if isinstance(name, str):
        if name not in SHAPES:
            raise SpecgraphError(f"--widen: unknown shape {name!r}; valid: {', '.join(SHAPES)}")
        big, tied, _ = SHAPES[name]
    else:
        big = name
    problems = misfits(small, big)
    if problems:
        fitting = [n for n, (shape, _, _) in SHAPES.items() if not misfits(small, shape)]
        raise SpecgraphError(f"--widen {name}: {what} does not fit it ({'; '.join(problems)}); shapes that fit it: "
                             f"{', '.join(fitting) or 'none'}")
    kind = type(small)
    if kind is HybridShape:
        return replace(big, rms_norm_eps=small.rms_norm_eps, rotary_dim=small.rotary_dim), tied
    return replace(big, rms_norm_eps=small.rms_norm_eps, qkv_bias=small.qkv_bias, o_bias=small.o_bias,
                   mlp_bias=small.mlp_bias, qk_norm=small.qk_norm), tied


def grouped_rows(heads: int, group: int, big_group: int, width: int) -> torch.Tensor:
    """Rows of small heads in the big model: head i (of key/value group i // group) becomes head
    (i // group) * big_group + i % group, each `width` rows."""
    return torch.cat([torch.arange(width) + width * ((i // group) * big_group + i % group) for i in range(heads)])


class _Filler:
    """Writes a small model's weights into a zeroed big one on `device`."""

    def __init__(self, small_hidden: int, big_hidden: int, device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.cols = torch.arange(small_hidden)[None, :]  # the small hidden columns
        self.norm_scale = math.sqrt(small_hidden / big_hidden)

    def materialize(self, module: torch.nn.Module) -> None:
        module.to_empty(device=self.device)
        module.to(self.dtype)
        for p in module.parameters():
            p.zero_()

    def put(self, dest: torch.Tensor, src: torch.Tensor, rows, cols=None) -> None:
        src = src.to(device=self.device, dtype=self.dtype)
        if cols is None:
            dest[rows] = src
        else:
            dest[rows, cols] = src

    def hidden_norm(self, dest: torch.nn.Module, src: torch.nn.Module, eps: float) -> None:
        """An RMSNorm over the hidden size: weight scaled, eps given (see the module docstring)."""
        self.put(dest.weight, src.weight * self.norm_scale, slice(0, src.weight.numel()))
        dest.eps = eps

    def ends(self, wide: torch.nn.Module, small: torch.nn.Module, tied: bool, eps: float) -> None:
        """Embedding, head and final norm."""
        for module in (wide.embed_tokens, wide.norm, wide.lm_head):
            self.materialize(module)
        if tied:
            wide.lm_head.weight = wide.embed_tokens.weight
        v, h = small.embed_tokens.weight.shape
        self.put(wide.embed_tokens.weight, small.embed_tokens.weight, slice(0, v), slice(0, h))
        if not tied:
            self.put(wide.lm_head.weight, small.lm_head.weight, slice(0, v), slice(0, h))
        self.hidden_norm(wide.norm, small.norm, eps)
        wide.inv_freq = small.inv_freq.to(self.device)
        wide.rope_scale = small.rope_scale
        wide.served_vocab = small.served_vocab

    def mlp_and_norms(self, b: torch.nn.Module, a: torch.nn.Module, eps: float) -> None:
        inter, h = a.mlp.down_proj.weight.shape[1], a.mlp.down_proj.weight.shape[0]
        for src, dest in zip(a.mlp.gate_up_proj.weight.chunk(2), b.mlp.gate_up_proj.weight.chunk(2)):  # gate, up
            self.put(dest, src, slice(0, inter), slice(0, h))
        self.put(b.mlp.down_proj.weight, a.mlp.down_proj.weight, slice(0, h), slice(0, inter))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            self.hidden_norm(getattr(b, norm), getattr(a, norm), eps)


@torch.no_grad()
def widen(small: LlamaModel | HybridModel, name: str | LlamaShape | HybridShape, device: torch.device | str,
          dtype: torch.dtype, tied: bool = False, shard: tuple[int, int, object] | None = None,
          what: str = "the model", quantize: str | None = None) -> LlamaModel | HybridModel:
    """A model of shape `name` on `device`, built there directly, computing `small`'s function.
    `shard` = (rank, world, process group): keep only that rank's tensor-parallel shard; layers
    are built and sharded one at a time, so the whole model is never on one device. `quantize`: a
    scheme of `specgraph quantize` (w4a16, w8a16, fp8) for each layer's projections, applied as
    each layer is built (a 70B shape in int4 never holds more than one layer in full precision).
    `what`: the model, for errors."""
    if any(isinstance(m, QuantLinear) for m in small.modules()):
        raise SpecgraphError(f"--widen: {what} has quantized weights; widen a checkpoint in full precision")
    s = small.shape
    big, tied = widened_shape(s, name, tied, what)
    if isinstance(small, Eagle3Head):
        return _widen_head(small, big, device, dtype)
    where = f"--widen {name if isinstance(name, str) else 'shape'}"
    if shard is not None:
        if quantize is not None:
            raise SpecgraphError(f"{where}:{quantize}: quantized weights run on one device; give {what} one device")
        sharded_shape(big, shard[1], shard[0], where)  # fail before building
    with torch.device("meta"):
        wide = HybridModel(big) if isinstance(big, HybridShape) else LlamaModel(big)
    fill = _Filler(s.hidden_size, big.hidden_size, device, dtype)
    eps = s.rms_norm_eps * s.hidden_size / big.hidden_size
    fill.ends(wide, small, tied, eps)
    copy_layer = _hybrid_layer if isinstance(big, HybridShape) else _llama_layer
    for i, b in enumerate(wide.layers):
        fill.materialize(b)  # layers past the small model's stay zero: they pass the residual through
        b.input_layernorm.eps = b.post_attention_layernorm.eps = eps
        if i < len(small.layers):
            copy_layer(fill, small.layers[i], b, s, big)
            fill.mlp_and_norms(b, small.layers[i], eps)
        if shard is not None:
            shard_layer(b, big, *shard)
        if quantize is not None:
            quantize_projections(b, quantize)
    if shard is not None:
        wide.shape = sharded_shape(big, shard[1], shard[0])
    return wide.eval().requires_grad_(False)


def _widen_head(small: Eagle3Head, target: LlamaShape, device: torch.device | str, dtype: torch.dtype) -> Eagle3Head:
    """An EAGLE-3 head at the shape of a head for `target` (its width, heads and MLP; the published
    draft vocabulary) computing `small`'s function over the widened target's features, which carry
    the small target's in their leading columns (every widened layer's output rows past them are
    zero). The embedding stays the target's (the lowering ties it)."""
    s, head = small.shape, small.head
    big = HeadShape(replace(target, num_layers=1), target.hidden_size, max(HEAD_DRAFT_VOCAB, head.draft_vocab_size),
                    head.features)
    with torch.device("meta"):
        wide = Eagle3Head(big)
    fill = _Filler(s.hidden_size, target.hidden_size, device, dtype)
    eps = s.rms_norm_eps * s.hidden_size / target.hidden_size
    fill.materialize(wide)
    a, b = small.layers[0], wide.layers[0]
    b.input_layernorm.eps = b.post_attention_layernorm.eps = eps
    both = torch.cat([torch.arange(s.hidden_size) + target.hidden_size * k for k in range(2)])  # [embedding, hidden]
    _llama_layer(fill, a, b, s, big.layer, both[None, :])
    fill.mlp_and_norms(b, a, eps)
    fill.hidden_norm(b.hidden_norm, a.hidden_norm, eps)
    fill.hidden_norm(wide.norm, small.norm, eps)
    features = torch.cat([torch.arange(head.target_hidden_size) + target.hidden_size * k for k in range(3)])
    fill.put(wide.fc.weight, small.fc.weight, torch.arange(s.hidden_size)[:, None], features[None, :])
    fill.put(wide.lm_head.weight, small.lm_head.weight, slice(0, head.draft_vocab_size), slice(0, s.hidden_size))
    wide.d2t.zero_()[: head.draft_vocab_size] = small.d2t.to(wide.d2t.device)  # (ids past served_vocab: never served)
    wide.t2d.zero_()[: head.layer.vocab_size] = small.t2d.to(wide.t2d.device)
    wide.inv_freq, wide.rope_scale = small.inv_freq.to(device), small.rope_scale
    wide.served_vocab, wide.target_vocab, wide.shares_embedding = small.served_vocab, small.target_vocab, \
        small.shares_embedding
    if not small.shares_embedding:
        v, h = small.embed_tokens.weight.shape
        fill.put(wide.embed_tokens.weight, small.embed_tokens.weight, slice(0, v), slice(0, h))
    return wide.eval().requires_grad_(False)


def _llama_layer(fill: _Filler, a: torch.nn.Module, b: torch.nn.Module, s: LlamaShape, big: LlamaShape,
                 cols: torch.Tensor | None = None) -> None:
    """A decoder layer's attention; `cols`: where the small q/k/v input columns go (default: the leading ones)."""
    cols = fill.cols if cols is None else cols
    d, h = s.head_dim, s.hidden_size
    q_rows = grouped_rows(s.num_heads, s.num_heads // s.num_kv_heads, big.num_heads // big.num_kv_heads, d)
    kv_rows = torch.arange(s.num_kv_heads * d)
    small_qkv, big_qkv = (qkv_sizes(x.num_heads, x.num_kv_heads, d) for x in (s, big))
    sa, ba = a.self_attn, b.self_attn
    for part, rows in enumerate((q_rows, kv_rows, kv_rows)):
        src = [x.split(small_qkv)[part] for x in (sa.qkv_proj.weight, sa.qkv_proj.bias) if x is not None]
        dest = [x.split(big_qkv)[part] for x in (ba.qkv_proj.weight, ba.qkv_proj.bias) if x is not None]
        fill.put(dest[0], src[0], rows[:, None], cols)
        if len(src) > 1:
            fill.put(dest[1], src[1], rows)
    fill.put(ba.o_proj.weight, sa.o_proj.weight, torch.arange(h)[:, None], q_rows[None, :])
    if sa.o_proj.bias is not None:
        fill.put(ba.o_proj.bias, sa.o_proj.bias, slice(0, h))
    if s.qk_norm:
        fill.put(ba.q_norm.weight, sa.q_norm.weight, slice(None))
        fill.put(ba.k_norm.weight, sa.k_norm.weight, slice(None))


def _hybrid_layer(fill: _Filler, a: torch.nn.Module, b: torch.nn.Module, s: HybridShape, big: HybridShape) -> None:
    rows_out = torch.arange(s.hidden_size)[:, None]
    if a.kind == FULL:
        d, sa, ba = s.head_dim, a.self_attn, b.self_attn
        group, big_group = s.num_heads // s.num_kv_heads, big.num_heads // big.num_kv_heads
        kv_rows = torch.arange(s.num_kv_heads * d)
        rows = (grouped_rows(s.num_heads, group, big_group, 2 * d), kv_rows, kv_rows)  # (q, gate) per head, k, v
        for src, dest, r in zip(sa.qkv_proj.weight.split(s.fused_sizes()["self_attn.qkv_proj"]),
                                ba.qkv_proj.weight.split(big.fused_sizes()["self_attn.qkv_proj"]), rows):
            fill.put(dest, src, r[:, None], fill.cols)
        fill.put(ba.o_proj.weight, sa.o_proj.weight, rows_out, grouped_rows(s.num_heads, group, big_group, d)[None, :])
        fill.put(ba.q_norm.weight, sa.q_norm.weight, slice(None))
        fill.put(ba.k_norm.weight, sa.k_norm.weight, slice(None))
        return
    sa, ba = a.linear_attn, b.linear_attn
    dk, dv = s.linear_key_dim, s.linear_value_dim
    group, big_group = (x.linear_value_heads // x.linear_key_heads for x in (s, big))
    keys = torch.arange(s.linear_key_heads * dk)

    def values(width: int) -> torch.Tensor:
        return grouped_rows(s.linear_value_heads, group, big_group, width)

    def sections(x: HybridShape, weight: torch.Tensor) -> list[torch.Tensor]:
        """Views of the rows of an in_proj weight (q, k, v: the convolved channels; z, b, a) or a
        conv weight (q, k, v)."""
        sizes = x.linear_sizes()
        qkv = weight[: sizes[0]].split([x.linear_key_heads * dk] * 2 + [x.linear_value_heads * dv])
        return [*qkv, *weight[sizes[0]:].split(sizes[1:])] if weight.shape[0] > sizes[0] else list(qkv)

    channel_rows = (keys, keys, values(dv))
    for src, dest, r in zip(sections(s, sa.in_proj.weight), sections(big, ba.in_proj.weight),
                            channel_rows + (values(dv), values(1), values(1))):
        fill.put(dest, src, r[:, None], fill.cols)
    for src, dest, r in zip(sections(s, sa.conv1d.weight), sections(big, ba.conv1d.weight), channel_rows):
        fill.put(dest, src, r)
    fill.put(ba.dt_bias, sa.dt_bias, values(1))
    fill.put(ba.A_log, sa.A_log, values(1))
    fill.put(ba.norm.weight, sa.norm.weight, slice(None))
    fill.put(ba.out_proj.weight, sa.out_proj.weight, rows_out, values(dv)[None, :])
