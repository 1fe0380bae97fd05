"""capture_graphs: list the forward sizes each stage replays as CUDA graphs.

Before: stages carry `device` and the tree plan.
After:  + `graph_buckets`: the token counts T of the forwards a step runs, each captured once and
        replayed (empty on the CPU or with `lowering.cuda_graphs: false`):
          target  - 1 (autoregressive) and the drafter's tree + root;
          drafter - 1 and 2 (catch-up: the bonus, maybe after one accepted leaf) and the batch
                    sizes of its tree expansion (nodes per depth with children; the width for
                    dynamic trees).
        Other sizes (prefill) run eagerly.
"""

from __future__ import annotations

from specgraph.graph import SpecGraph
from specgraph.passes.base import graph_pass
from specgraph.recipe import DynamicTree


def expansion_sizes(tree) -> set[int]:
    if isinstance(tree, DynamicTree):
        return {tree.width}
    return {len(tree.expanding(depth)) for depth in range(1, tree.max_depth)}


@graph_pass(requires=("device", "tree", "tree_nodes"), provides=("graph_buckets",))
def capture_graphs(graph: SpecGraph) -> SpecGraph:
    for name in graph.stages():
        node = graph.node(name)
        if node["device"].type != "cuda" or not graph.recipe.lowering.cuda_graphs:
            node["graph_buckets"] = ()
            continue
        drafter = graph.drafter_of(name)
        if name == graph.target:
            sizes = {1} | ({graph.node(drafter)["tree_nodes"] + 1} if drafter else set())
        else:
            sizes = {1, 2} | expansion_sizes(node["tree"])
        node["graph_buckets"] = tuple(sorted(sizes))
    return graph
