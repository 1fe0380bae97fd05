"""Tensor parallelism: a function from a model to one rank's shard of it (gpt-fast's tp.py idea).

Rank r of W keeps, in every decoder layer, query heads [r H/W, (r+1) H/W) and KV heads
[r Hkv/W, (r+1) Hkv/W) (their q/k/v rows and o_proj columns; where Hkv < W, the one KV head its
query heads read) and MLP units [r I/W, (r+1) I/W) (gate/up rows, down_proj columns); in a hybrid's
gated-DeltaNet layers, its share of the key heads and of the value heads (their q/k/v, z, b, a
rows, conv channels, gates and out_proj columns: each value head stays with the key head it
reads). The outputs of o_proj (out_proj) and down_proj are summed over the group (one all-reduce
each per layer). Embeddings, norms and the LM head stay whole on every rank, so
every rank computes the same logits and takes the same decisions: each rank runs the same
executor on its shard, and rank 0 reports.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from specgraph.errors import RecipeError
from specgraph.models.hybrid import GatedDeltaNet, HybridLayer, HybridModel, HybridShape
from specgraph.models.llama import DecoderLayer, LlamaModel, LlamaShape


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def sharded_shape(shape: LlamaShape | HybridShape, world: int, where: str = "model") -> LlamaShape | HybridShape:
    """The shape one rank holds; refuses shapes that do not split evenly or would add biases W times.
    KV heads fewer than the ranks (their count dividing the ranks) are replicated: each rank keeps
    the one its query heads read."""
    split = ["num_heads", "intermediate_size"]
    if isinstance(shape, HybridShape):
        split += ["linear_key_heads", "linear_value_heads"]
    if shape.num_kv_heads % world and world % shape.num_kv_heads:
        split.append("num_kv_heads")
    uneven = [f"{f} {getattr(shape, f)}" for f in split if getattr(shape, f) % world]
    if uneven:
        raise RecipeError(f"{where}: {', '.join(uneven)} {'do' if len(uneven) > 1 else 'does'} not split over "
                          f"{world} devices")
    if getattr(shape, "o_bias", False) or shape.mlp_bias:
        raise RecipeError(f"{where}: output-projection biases are not supported with tensor parallelism")
    return replace(shape, **{f: getattr(shape, f) // world for f in split},
                   num_kv_heads=max(1, shape.num_kv_heads // world))


def _rows(weight: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Rank's share of each consecutive block of rows (blocks of `sizes` rows), concatenated."""
    return torch.cat([block.chunk(world)[rank] for block in weight.split(sizes)]).clone()


def _attention_rows(weight: torch.Tensor, kv_rows: int, kv_heads: int, rank: int, world: int) -> torch.Tensor:
    """Rank's rows of a fused q(+gate)/k/v projection (`kv_rows` rows each of k and v): its share of the
    query rows, and of the k and v rows its KV heads' (the one KV head its query heads read where KV
    heads are fewer than the ranks)."""
    queries, keys, values = weight.split([weight.shape[0] - 2 * kv_rows, kv_rows, kv_rows])
    if kv_heads % world == 0:
        kv = [x.chunk(world)[rank] for x in (keys, values)]
    else:
        kv = [x.chunk(kv_heads)[rank * kv_heads // world] for x in (keys, values)]
    return torch.cat([queries.chunk(world)[rank], *kv]).clone()


def _parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


@torch.no_grad()
def shard_layer(layer: DecoderLayer | HybridLayer, shape: LlamaShape | HybridShape, rank: int, world: int,
                group) -> None:
    """Keep rank's heads and MLP units of `layer` (of the whole model's `shape`) in place."""
    local = sharded_shape(shape, world)
    reduce = partial(funcol.all_reduce, reduceOp="sum", group=group)
    attn = getattr(layer, "self_attn", None)
    if attn is not None:
        kv_rows, kv = shape.num_kv_heads * shape.head_dim, shape.num_kv_heads
        attn.qkv_proj.weight = _parameter(_attention_rows(attn.qkv_proj.weight, kv_rows, kv, rank, world))
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias = _parameter(_attention_rows(attn.qkv_proj.bias, kv_rows, kv, rank, world))
        attn.o_proj.weight = _parameter(attn.o_proj.weight.chunk(world, dim=1)[rank].clone())
        attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
        attn.reduce = reduce
    else:
        _shard_delta_net(layer.linear_attn, shape, local, rank, world)
        layer.linear_attn.reduce = reduce
    mlp = layer.mlp
    gate_up = [shape.intermediate_size] * 2
    mlp.gate_up_proj.weight = _parameter(_rows(mlp.gate_up_proj.weight, gate_up, rank, world))
    mlp.down_proj.weight = _parameter(mlp.down_proj.weight.chunk(world, dim=1)[rank].clone())
    mlp.reduce = reduce


def _shard_delta_net(net: GatedDeltaNet, shape: HybridShape, local: HybridShape, rank: int, world: int) -> None:
    """Rank's key heads and value heads (each value head with the key head it reads): their rows of
    the fused input projection and the conv, their gates, and their columns of out_proj."""
    conv = shape.linear_sizes()[0]
    key_rows = shape.linear_key_heads * shape.linear_key_dim
    channels = [key_rows, key_rows, conv - 2 * key_rows]  # q, k, v
    net.in_proj.weight = _parameter(_rows(net.in_proj.weight, channels + shape.linear_sizes()[1:], rank, world))
    net.conv1d.weight = _parameter(_rows(net.conv1d.weight, channels, rank, world))
    net.dt_bias = _parameter(net.dt_bias.chunk(world)[rank].clone())
    net.A_log = _parameter(net.A_log.chunk(world)[rank].clone())
    net.out_proj.weight = _parameter(net.out_proj.weight.chunk(world, dim=1)[rank].clone())
    net.shape = local


def shard_model(model: LlamaModel | HybridModel, rank: int, world: int, group,
                where: str = "model") -> LlamaModel | HybridModel:
    """`model` becomes rank's shard (in place; returned for chaining)."""
    shape = model.shape
    model.shape = sharded_shape(shape, world, where)
    for layer in model.layers:
        shard_layer(layer, shape, rank, world, group)
    return model
