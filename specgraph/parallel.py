"""Tensor parallelism: a function from a model to one rank's shard of it (gpt-fast's tp.py idea).

Rank r of W keeps, in every decoder layer, a contiguous range of query heads with the KV heads
they read (`split_heads`: whole KV groups, as evenly as the counts allow; where KV heads are fewer
than the ranks, each is kept by its share of the ranks, which split its query heads) — their
q/k/v rows and o_proj columns — and a contiguous range of MLP units (gate/up rows, down_proj
columns); in a hybrid's gated-DeltaNet layers, value heads with the key heads they read the same
way (their q/k/v, z, b, a rows, conv channels, gates and out_proj columns). Counts that do not
divide by W split unevenly (rank r takes one more where r < count % W): every rank is its own
process with its own shapes, and the sums below do not care how the terms were cut. The outputs
of o_proj (out_proj) and down_proj are summed over the group (one all-reduce each per layer).
Embeddings, norms and the LM head stay whole on every rank, so every rank computes the same
logits and takes the same decisions: each rank runs the same executor on its shard, and rank 0
reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from specgraph.errors import RecipeError
from specgraph.models.hybrid import GatedDeltaNet, HybridLayer, HybridModel, HybridShape
from specgraph.models.llama import DecoderLayer, LlamaModel, LlamaShape


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def share(count: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous share of `count` items over `world` ranks -> (start, size): sizes differ by at most one."""
    size, extra = divmod(count, world)
    return rank * size + min(rank, extra), size + (rank < extra)


@dataclass(frozen=True)
class HeadSplit:
    """One rank's query heads [q0, q0 + q) and the KV heads [kv0, kv0 + kv) they read."""

    q0: int
    q: int
    kv0: int
    kv: int


def split_heads(heads: int, kv_heads: int, world: int, rank: int,
                what: tuple[str, str] = ("num_heads", "KV heads")) -> HeadSplit:
    """Rank's query heads by whole KV groups (query head i reads KV head i // (heads / kv_heads));
    with fewer KV heads than ranks, KV head g is kept by ranks `share(world, kv_heads, g)`, which
    share its query heads."""
    group = heads // kv_heads
    if kv_heads >= world:
        kv0, kv = share(kv_heads, world, rank)
        return HeadSplit(kv0 * group, kv * group, kv0, kv)
    for g in range(kv_heads):
        first, ranks = share(world, kv_heads, g)
        if first <= rank < first + ranks:
            q0, q = share(group, ranks, rank - first)
            if q == 0:
                raise RecipeError(f"{what[0]} {heads} over {kv_heads} {what[1]} give some of {world} devices no "
                                  f"head; use at most {heads} devices")
            return HeadSplit(g * group + q0, q, g, 1)
    raise AssertionError("rank outside the group")


def sharded_shape(shape: LlamaShape | HybridShape, world: int, rank: int, where: str = "model") -> LlamaShape | HybridShape:
    """The shape rank `rank` of `world` holds (see the module doc); refuses output-projection biases
    (they would be added W times) and splits that leave any rank no head (every rank says so)."""
    if getattr(shape, "o_bias", False) or shape.mlp_bias:
        raise RecipeError(f"{where}: output-projection biases are not supported with tensor parallelism")
    try:
        heads, values = ([split_heads(shape.num_heads, shape.num_kv_heads, world, r) for r in range(world)],
                         [split_heads(shape.linear_value_heads, shape.linear_key_heads, world, r,
                                      ("linear_value_heads", "key heads")) for r in range(world)]
                         if isinstance(shape, HybridShape) else None)
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc}") from None
    fields = {"num_heads": heads[rank].q, "num_kv_heads": heads[rank].kv,
              "intermediate_size": share(shape.intermediate_size, world, rank)[1]}
    if values is not None:
        fields |= {"linear_value_heads": values[rank].q, "linear_key_heads": values[rank].kv}
    return replace(shape, **fields)


def _rows(weight: torch.Tensor, blocks: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """Of consecutive blocks of rows, given as (rows, per item, first item, items), the items' rows, concatenated."""
    parts = weight.split([rows for rows, _, _, _ in blocks])
    return torch.cat([part[first * per:(first + items) * per] for part, (_, per, first, items) in zip(parts, blocks)]).clone()


def _columns(weight: torch.Tensor, per: int, first: int, items: int) -> torch.Tensor:
    return weight[:, first * per:(first + items) * per].clone()


def _parameter(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


@torch.no_grad()
def shard_layer(layer: DecoderLayer | HybridLayer, shape: LlamaShape | HybridShape, rank: int, world: int,
                group) -> None:
    """Keep rank's heads and MLP units of `layer` (of the whole model's `shape`) in place."""
    local = sharded_shape(shape, world, rank)
    reduce = partial(funcol.all_reduce, reduceOp="sum", group=group)
    attn = getattr(layer, "self_attn", None)
    if attn is not None:
        heads, d = split_heads(shape.num_heads, shape.num_kv_heads, world, rank), shape.head_dim
        kv_rows = shape.num_kv_heads * d
        queries = attn.qkv_proj.weight.shape[0] - 2 * kv_rows  # (a hybrid's gated attention: q and gate per head)
        blocks = [(queries, queries // shape.num_heads, heads.q0, heads.q)] + [(kv_rows, d, heads.kv0, heads.kv)] * 2
        attn.qkv_proj.weight = _parameter(_rows(attn.qkv_proj.weight, blocks))
        if attn.qkv_proj.bias is not None:
            attn.qkv_proj.bias = _parameter(_rows(attn.qkv_proj.bias, blocks))
        attn.o_proj.weight = _parameter(_columns(attn.o_proj.weight, d, heads.q0, heads.q))
        attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
        attn.reduce = reduce
    else:
        _shard_delta_net(layer.linear_attn, shape, local, rank, world)
        layer.linear_attn.reduce = reduce
    mlp, units = layer.mlp, share(shape.intermediate_size, world, rank)
    mlp.gate_up_proj.weight = _parameter(_rows(mlp.gate_up_proj.weight, [(shape.intermediate_size, 1, *units)] * 2))
    mlp.down_proj.weight = _parameter(_columns(mlp.down_proj.weight, 1, *units))
    mlp.reduce = reduce


def _shard_delta_net(net: GatedDeltaNet, shape: HybridShape, local: HybridShape, rank: int, world: int) -> None:
    """Rank's value heads and the key heads they read: their rows of the fused input projection
    (q, k, v, z, b, a) and the conv (q, k, v), their gates, and their columns of out_proj."""
    heads = split_heads(shape.linear_value_heads, shape.linear_key_heads, world, rank)
    dk, dv, h = shape.linear_key_dim, shape.linear_value_dim, shape.linear_value_heads
    keys = (shape.linear_key_heads * dk, dk, heads.kv0, heads.kv)
    values = (h * dv, dv, heads.q0, heads.q)
    gates = (h, 1, heads.q0, heads.q)
    net.in_proj.weight = _parameter(_rows(net.in_proj.weight, [keys, keys, values, values, gates, gates]))
    net.conv1d.weight = _parameter(_rows(net.conv1d.weight, [keys, keys, values]))
    net.dt_bias = _parameter(net.dt_bias[heads.q0:heads.q0 + heads.q].clone())
    net.A_log = _parameter(net.A_log[heads.q0:heads.q0 + heads.q].clone())
    net.out_proj.weight = _parameter(_columns(net.out_proj.weight, dv, heads.q0, heads.q))
    net.shape = local


def shard_model(model: LlamaModel | HybridModel, rank: int, world: int, group,
                where: str = "model") -> LlamaModel | HybridModel:
    """`model` becomes rank's shard (in place; returned for chaining)."""
    shape = model.shape
    model.shape = sharded_shape(shape, world, rank, where)
    for layer in model.layers:
        shard_layer(layer, shape, rank, world, group)
    return model
