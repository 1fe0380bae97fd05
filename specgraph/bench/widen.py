"""Widen a small trained model into a model of a real model's shape that computes the same function.

Trained weights go into the leading rows/columns and every other weight is zero: extra attention
heads get zero query/key/value rows and zero output columns, extra MLP units zero rows and columns,
extra layers zero output projections (o_proj, down_proj) so they pass the residual through, extra
vocabulary rows zero (and are never served: `served_vocab` keeps the logits to the trained ids).
Hidden-size RMSNorm weights scale by sqrt(small/big) and eps by small/big, which cancels the larger
mean denominator. Head dimensions stay, so softmax scale, rotary dims and per-head norms are
unchanged. Every byte is still read and every product computed: time and memory are the real
shape's, predictions (and so acceptance) are the trained model's.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from specgraph.errors import SpecgraphError
from specgraph.models.llama import LlamaModel, LlamaShape, qkv_sizes
from specgraph.parallel import shard_layer, sharded_shape

# name -> (shape with the small model's norm eps filled in by `widen`, tied embeddings, real parameter count)
SHAPES: dict[str, tuple[LlamaShape, bool, int]] = {
    "llama-3.2-1b": (LlamaShape(128256, 2048, 8192, 16, 32, 8, 64, 1e-5), True, 1_235_814_400),
    "llama-3.2-3b": (LlamaShape(128256, 3072, 8192, 28, 24, 8, 128, 1e-5), True, 3_212_749_824),
    "llama-3-8b": (LlamaShape(128256, 4096, 14336, 32, 32, 8, 128, 1e-5), False, 8_030_261_248),
    "llama-3-70b": (LlamaShape(128256, 8192, 28672, 80, 64, 8, 128, 1e-5), False, 70_553_706_496),
}
DRAFT_SHAPES = ("llama-3.2-1b", "llama-3.2-3b")  # drafters widen to the small shape with their head dim


def draft_shape_for(small: LlamaShape) -> str:
    for name in DRAFT_SHAPES:
        if SHAPES[name][0].head_dim == small.head_dim:
            return name
    raise SpecgraphError(f"no draft shape has head_dim {small.head_dim}; shapes: {', '.join(DRAFT_SHAPES)}")


def widened_shape(small: LlamaShape, name: str | LlamaShape, tied: bool = False) -> tuple[LlamaShape, bool]:
    """The shape `name` (a SHAPES key, or a LlamaShape with `tied`) with the small model's norm eps and flags."""
    if isinstance(name, str):
        if name not in SHAPES:
            raise SpecgraphError(f"--widen: unknown shape {name!r}; valid: {', '.join(SHAPES)}")
        big, tied, _ = SHAPES[name]
    else:
        big = name
    problems = [f"{field} {getattr(small, field)} > {getattr(big, field)}"
                for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
                if getattr(small, field) > getattr(big, field)]
    if small.head_dim != big.head_dim:
        problems.append(f"head_dim {small.head_dim} != {big.head_dim}")
    if small.num_heads // small.num_kv_heads > big.num_heads // big.num_kv_heads:
        problems.append("query heads per kv head exceed the shape's")
    if problems:
        raise SpecgraphError(f"--widen {name}: the model does not fit ({'; '.join(problems)})")
    return replace(big, rms_norm_eps=small.rms_norm_eps, qkv_bias=small.qkv_bias, o_bias=small.o_bias,
                   mlp_bias=small.mlp_bias, qk_norm=small.qk_norm), tied


@torch.no_grad()
def widen(small: LlamaModel, name: str | LlamaShape, device: torch.device | str, dtype: torch.dtype,
          tied: bool = False, shard: tuple[int, int, object] | None = None) -> LlamaModel:
    """A model of shape `name` on `device`, built there directly, computing `small`'s function.
    `shard` = (rank, world, process group): keep only that rank's tensor-parallel shard; layers
    are built and sharded one at a time, so the whole model is never on one device."""
    s = small.shape
    big, tied = widened_shape(s, name, tied)
    if shard is not None:
        sharded_shape(big, shard[1], f"--widen {name if isinstance(name, str) else 'shape'}")  # fail before building
    with torch.device("meta"):
        wide = LlamaModel(big)

    def materialize(module: torch.nn.Module) -> None:
        module.to_empty(device=device)
        module.to(dtype)
        for p in module.parameters():
            p.zero_()

    for module in (wide.embed_tokens, wide.norm, wide.lm_head):
        materialize(module)
    if tied:
        wide.lm_head.weight = wide.embed_tokens.weight
    h, d, v = s.hidden_size, s.head_dim, s.vocab_size
    norm_scale = math.sqrt(h / big.hidden_size)
    eps = s.rms_norm_eps * h / big.hidden_size
    group, big_group = s.num_heads // s.num_kv_heads, big.num_heads // big.num_kv_heads
    # small query head i (kv head i // group) -> big head (i // group) * big_group + i % group
    q_rows = torch.cat([torch.arange(d) + d * ((i // group) * big_group + i % group) for i in range(s.num_heads)])
    kv_rows = torch.arange(s.num_kv_heads * d)
    small_qkv, big_qkv = (qkv_sizes(x.num_heads, x.num_kv_heads, d) for x in (s, big))

    def put(dest: torch.Tensor, src: torch.Tensor, rows, cols=None) -> None:
        src = src.to(device=device, dtype=dtype)
        if cols is None:
            dest[rows] = src
        else:
            dest[rows, cols] = src

    put(wide.embed_tokens.weight, small.embed_tokens.weight, slice(0, v), slice(0, h))
    if not tied:
        put(wide.lm_head.weight, small.lm_head.weight, slice(0, v), slice(0, h))
    for i, b in enumerate(wide.layers):
        materialize(b)  # layers past the small model's stay zero: they pass the residual through
        if i < len(small.layers):
            a = small.layers[i]
            sa, ba = a.self_attn, b.self_attn
            for part, rows in enumerate((q_rows, kv_rows, kv_rows)):
                src = [x.split(small_qkv)[part] for x in (sa.qkv_proj.weight, sa.qkv_proj.bias) if x is not None]
                dest = [x.split(big_qkv)[part] for x in (ba.qkv_proj.weight, ba.qkv_proj.bias) if x is not None]
                put(dest[0], src[0], rows[:, None], torch.arange(h)[None, :])
                if len(src) > 1:
                    put(dest[1], src[1], rows)
            put(ba.o_proj.weight, sa.o_proj.weight, torch.arange(h)[:, None], q_rows[None, :])
            if sa.o_proj.bias is not None:
                put(ba.o_proj.bias, sa.o_proj.bias, slice(0, h))
            if s.qk_norm:
                put(ba.q_norm.weight, sa.q_norm.weight, slice(None))
                put(ba.k_norm.weight, sa.k_norm.weight, slice(None))
            inter = s.intermediate_size
            for src, dest in zip(a.mlp.gate_up_proj.weight.chunk(2), b.mlp.gate_up_proj.weight.chunk(2)):  # gate, up
                put(dest, src, slice(0, inter), slice(0, h))
            put(b.mlp.down_proj.weight, a.mlp.down_proj.weight, slice(0, h), slice(0, inter))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(getattr(b, norm).weight, getattr(a, norm).weight * norm_scale, slice(0, h))
        b.input_layernorm.eps = b.post_attention_layernorm.eps = eps
        if shard is not None:
            shard_layer(b, big, *shard)
    put(wide.norm.weight, small.norm.weight * norm_scale, slice(0, h))
    wide.norm.eps = eps
    if shard is not None:
        wide.shape = sharded_shape(big, shard[1])
    wide.inv_freq = small.inv_freq.to(device)
    wide.rope_scale = small.rope_scale
    wide.served_vocab = small.served_vocab
    return wide.eval().requires_grad_(False)
