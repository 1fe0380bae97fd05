"""Tensor parallelism: a function from a model to one rank's shard of it (gpt-fast's tp.py idea).

Rank r of W keeps, in every decoder layer, query heads [r H/W, (r+1) H/W) and KV heads
[r Hkv/W, (r+1) Hkv/W) (their q/k/v rows and o_proj columns) and MLP units [r I/W, (r+1) I/W)
(gate/up rows, down_proj columns); the outputs of o_proj and down_proj are summed over the group
(one all-reduce each per layer). Embeddings, norms and the LM head stay whole on every rank, so
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
from specgraph.models.llama import DecoderLayer, LlamaModel, LlamaShape, qkv_sizes


def rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def sharded_shape(shape: LlamaShape, world: int, where: str = "model") -> LlamaShape:
    """The shape one rank holds; refuses shapes that do not split evenly or would add biases W times."""
    uneven = [f"{f} {getattr(shape, f)}" for f in ("num_heads", "num_kv_heads", "intermediate_size")
              if getattr(shape, f) % world]
    if uneven:
        raise RecipeError(f"{where}: {', '.join(uneven)} do not split over {world} devices")
    if shape.o_bias or shape.mlp_bias:
        raise RecipeError(f"{where}: output-projection biases are not supported with tensor parallelism")
    return replace(shape, num_heads=shape.num_heads // world, num_kv_heads=shape.num_kv_heads // world,
                   intermediate_size=shape.intermediate_size // world)


def _rows(weight: torch.Tensor, sizes: list[int], rank: int, world: int) -> torch.Tensor:
    """Rank's share of each consecutive block of rows (blocks of `sizes` rows), concatenated."""
    return torch.cat([block.chunk(world)[rank] for block in weight.split(sizes)]).clone()


@torch.no_grad()
def shard_layer(layer: DecoderLayer, shape: LlamaShape, rank: int, world: int, group) -> None:
    """Keep rank's heads and MLP units of `layer` (of the whole model's `shape`) in place."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = qkv_sizes(shape.num_heads, shape.num_kv_heads, shape.head_dim)
    attn.qkv_proj.weight = torch.nn.Parameter(_rows(attn.qkv_proj.weight, qkv, rank, world), requires_grad=False)
    if attn.qkv_proj.bias is not None:
        attn.qkv_proj.bias = torch.nn.Parameter(_rows(attn.qkv_proj.bias, qkv, rank, world), requires_grad=False)
    attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight.chunk(world, dim=1)[rank].clone(), requires_grad=False)
    attn.num_heads, attn.num_kv_heads = shape.num_heads // world, shape.num_kv_heads // world
    gate_up = [shape.intermediate_size] * 2
    mlp.gate_up_proj.weight = torch.nn.Parameter(_rows(mlp.gate_up_proj.weight, gate_up, rank, world), requires_grad=False)
    mlp.down_proj.weight = torch.nn.Parameter(mlp.down_proj.weight.chunk(world, dim=1)[rank].clone(), requires_grad=False)
    attn.reduce = mlp.reduce = partial(funcol.all_reduce, reduceOp="sum", group=group)


def shard_model(model: LlamaModel, rank: int, world: int, group, where: str = "model") -> LlamaModel:
    """`model` becomes rank's shard (in place; returned for chaining)."""
    shape = model.shape
    model.shape = sharded_shape(shape, world, where)
    for layer in model.layers:
        shard_layer(layer, shape, rank, world, group)
    return model
