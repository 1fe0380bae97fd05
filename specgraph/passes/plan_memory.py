"""plan_memory: size every stage's static buffers.

Before: stages carry `config`, `dtype` and the tree plan.
After:  + `step_tokens`: the most tokens one step writes past the committed prefix (the verified
        tree of the stage's drafter, or the drafter's own catch-up and tree, or the region of the
        tree it keeps growing);
        + `cache_slots`: KV slots = max_seq_len + step_tokens (in a pipeline, + a slack: a stage's
        committed tokens may pass the last stage's by what the stages may run ahead of each other
        and overshoot in one step); `kv_bytes`; `parameters` (the model's, counted from its
        config, whatever bytes each takes: a drafter no smaller than its target is warned of); `block_size`, `kv_blocks` and `requests`: the pool's blocks and the rows
        of its block table (_plan_pool). A pool too small for one request of max_seq_len tokens,
        or larger than its devices' memory, is refused here, before any weight is loaded.
"""

from __future__ import annotations

import warnings

import psutil
import torch

from specgraph.errors import RecipeError, RecipeWarning
from specgraph.graph import SpecGraph
from specgraph.models.hybrid import STEP_TOKENS, HybridShape
from specgraph.models.loader import model_shape
from specgraph.passes.base import graph_pass
from specgraph.passes.place import resolve_device
from specgraph.recipe import DynamicTree
from specgraph.tree import CATCH_UP, Growth


@graph_pass(requires=("config", "dtype", "tree_nodes", "window", "ahead", "feeds"), provides=("step_tokens", "cache_slots", "kv_bytes", "parameters", "block_size", "kv_blocks", "requests"))
def plan_memory(graph: SpecGraph) -> SpecGraph:
    max_seq_len = graph.recipe.max_seq_len
    stages = graph.stages()
    # a pipeline: each stage's tokens may pass the last stage's by what each stage may run ahead and overshoot
    slack = 0
    if graph.recipe.execution == "pipeline":
        slack = graph.node(stages[0])["tree_nodes"] + sum(
            (graph.node(n)["ahead"] or 0) + (graph.node(n)["window"] or 0) + 2 for n in stages)
    for name in stages:
        node = graph.node(name)
        drafter = graph.drafter_of(name)
        # A target writes its drafter's tree (+ root); a drafter writes its own tree (+ one catch-up token),
        # or the region of a tree it keeps growing; a pipeline stage verifies its window after its root and
        # the tokens it took from the stages above (at most one from each) that it has not fed yet.
        if node["window"]:
            step_tokens = 1 + node["window"] + len(stages) - 1 - node["index"]
        elif drafter:
            step_tokens = 1 + graph.node(drafter)["tree_nodes"]
        elif isinstance(node["tree"], Growth):
            step_tokens = node["tree"].region
        else:  # a drafter (or a target alone, as if it were one): its catch-up and the nodes it feeds
            fed = (node["tree"].depth - 1) * node["tree"].width if isinstance(node["tree"], DynamicTree) else 0
            step_tokens = (node["feeds"] or CATCH_UP) + max(node["tree_nodes"], fed)
        shape = model_shape(node["config"])
        if isinstance(shape, HybridShape) and step_tokens > STEP_TOKENS:
            if node["window"]:
                where, limit, what = f"stages.{node['index']}.verify.window", "target verifies", "this window and its root"
            elif drafter:
                where, limit, what = f"stages.{graph.node(drafter)['index']}.tree", "target verifies", "this tree and its root"
            else:
                where, limit, what = f"stages.{node['index']}.tree", "drafter feeds", "this tree and its catch-up"
            raise RecipeError(f"{where}: a hybrid {limit} at most {STEP_TOKENS} tokens per step; {what} are {step_tokens}")
        itemsize = node["dtype"].itemsize
        node["step_tokens"] = step_tokens
        node["cache_slots"] = max_seq_len + step_tokens + slack
        node["kv_bytes"] = shape.cache_bytes(node["cache_slots"], itemsize)
        tied = bool(node["config"].tie_word_embeddings)
        node["parameters"] = shape.parameter_count(tied)
    _plan_pool(graph)
    _check_pool_memory(graph)
    _warn_of_large_drafters(graph)
    return graph


def _plan_pool(graph: SpecGraph) -> None:
    """Every stage's KV pool: its blocks of `serving.block_size` slots and its table's rows. The
    serial executor's engine shares one block numbering among its stages (engine/pool.py) and has
    a row per request it decodes at once, plus a padding row; the other executors decode one
    request at a time, in row 0 of a pool of their own."""
    serving, size = graph.recipe.serving, graph.recipe.serving.block_size
    longest = max(graph.node(n)["cache_slots"] for n in graph.stages())
    for name in graph.stages():
        node = graph.node(name)
        node["block_size"] = size
        if graph.recipe.execution == "serial":
            least = 1 + -(-longest // size)  # the trash and one request of max_seq_len tokens and a step's region
            if serving.kv_blocks is not None and serving.kv_blocks < least:
                raise RecipeError(f"serving.kv_blocks: {serving.kv_blocks} blocks of {size} slots cannot hold one "
                                  f"request of max_seq_len {graph.recipe.max_seq_len} tokens and a step's "
                                  f"{longest - graph.recipe.max_seq_len} more (and block 0, the trash); give at least "
                                  f"{least}, or null for enough for max_batch requests")
            node["requests"] = serving.max_batch + 1
            node["kv_blocks"] = serving.kv_blocks or 1 + serving.max_batch * (least - 1)
        else:
            node["requests"], node["kv_blocks"] = 1, 1 + -(-node["cache_slots"] // size)


def _check_pool_memory(graph: SpecGraph) -> None:
    """Refuse KV pools that the memory of their devices cannot hold (the CPU's available memory, a
    GPU's total): the pool grows with serving.max_batch (`--batch`), or serving.kv_blocks where given."""
    need: dict[torch.device, int] = {}
    for name in graph.stages():
        node = graph.node(name)
        pool = model_shape(node["config"]).cache_bytes(node["kv_blocks"] * node["block_size"], node["dtype"].itemsize)
        devices = [resolve_device(d, f"stages.{node['index']}.devices") for d in node["spec"].devices]
        for device in devices:  # (a split stage's heads, and so its pool, are shared out among its devices)
            need[device] = need.get(device, 0) + pool // len(devices)
    for device, bytes_needed in need.items():
        has, what = device_memory(device)
        if has is None or bytes_needed <= has:
            continue
        serving, gb = graph.recipe.serving, f"{bytes_needed / 1e9:.1f} GB"
        where = f"on {device}, which has {has / 1e9:.1f} GB {what}"
        if serving.kv_blocks is not None:
            raise RecipeError(f"serving.kv_blocks: a pool of {serving.kv_blocks} blocks needs {gb} {where}; give "
                              f"at most {serving.kv_blocks * has // bytes_needed}")
        if graph.recipe.execution == "serial" and serving.max_batch > 1:
            raise RecipeError(f"serving.max_batch (--batch): {serving.max_batch} requests at once need a KV pool of "
                              f"{gb} {where}; at most {serving.max_batch * has // bytes_needed} fit")
        raise RecipeError(f"max_seq_len: a request of {graph.recipe.max_seq_len} tokens needs a KV cache of {gb} "
                          f"{where}; give a smaller max_seq_len")


def device_memory(device: torch.device) -> tuple[int | None, str]:
    """The bytes a pool may take on `device` and what they are: a CPU's available memory, a GPU's
    total; None where this process cannot see the GPU (a plan made for another machine)."""
    if device.type == "cuda":
        if (device.index or 0) >= torch.cuda.device_count():
            return None, "unknown"
        return torch.cuda.get_device_properties(device).total_memory, "in all"
    return psutil.virtual_memory().available, "available"


def _warn_of_large_drafters(graph: SpecGraph) -> None:
    """A drafter at least as large as the stage verifying it runs exactly but costs more than it can
    save: say so (a recipe mistake more often than a choice)."""
    for name in graph.stages()[1:]:
        below = graph.drafter_of(name)
        params = {n: graph.node(n)["parameters"] for n in (below, name)}
        if params[below] >= params[name]:
            warnings.warn(RecipeWarning(
                f"stage {below} ({params[below] / 1e6:.1f}M parameters) drafts for stage {name}, which is no larger "
                f"({params[name] / 1e6:.1f}M): speculation pays when the drafter is much smaller; check "
                "models and stages"), stacklevel=1)
