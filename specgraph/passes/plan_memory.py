"""plan_memory: size every stage's static buffers.

Before: stages carry `config`, `dtype` and the tree plan.
After:  + `step_tokens`: the most tokens one step writes past the committed prefix (the verified
        tree of the stage's drafter, or the drafter's own catch-up and tree, or the region of the
        tree it keeps growing);
        + `cache_slots`: KV slots = max_seq_len + step_tokens; `kv_bytes` and `weight_bytes`, for
        the report and for placement checks.
"""

from __future__ import annotations

from specgraph.errors import RecipeError
from specgraph.graph import SpecGraph
from specgraph.growing import GrowthPlan
from specgraph.models.hybrid import STEP_TOKENS, HybridShape
from specgraph.models.loader import model_shape
from specgraph.passes.base import graph_pass


@graph_pass(requires=("config", "dtype", "tree_nodes"), provides=("step_tokens", "cache_slots", "kv_bytes", "weight_bytes"))
def plan_memory(graph: SpecGraph) -> SpecGraph:
    max_seq_len = graph.recipe.max_seq_len
    for name in graph.stages():
        node = graph.node(name)
        drafter = graph.drafter_of(name)
        # A target writes its drafter's tree (+ root); a drafter writes its own tree (+ one catch-up token),
        # or the region of a tree it keeps growing.
        if drafter:
            step_tokens = 1 + graph.node(drafter)["tree_nodes"]
        elif isinstance(node["tree"], GrowthPlan):
            step_tokens = node["tree"].region
        else:
            step_tokens = 2 + node["tree_nodes"]
        shape = model_shape(node["config"])
        if isinstance(shape, HybridShape) and step_tokens > STEP_TOKENS:
            raise RecipeError(f"stages.{graph.node(drafter)['index']}.tree: a hybrid target verifies at most "
                              f"{STEP_TOKENS} tokens per step; this tree and its root are {step_tokens}")
        itemsize = node["dtype"].itemsize
        node["step_tokens"] = step_tokens
        node["cache_slots"] = max_seq_len + step_tokens
        node["kv_bytes"] = shape.cache_bytes(node["cache_slots"], itemsize)
        tied = bool(node["config"].tie_word_embeddings)
        node["weight_bytes"] = shape.parameter_count(tied) * itemsize
    return graph
