"""capture_graphs: plan what each stage replays as CUDA graphs.

Before: stages carry `device` and the tree plan.
After:  + `static_shapes` (bool): forwards attend over the whole cache (shapes depend on T only);
          true where CUDA graphs are on (a GPU, `lowering.cuda_graphs`);
        + `step_graphs` (bool, the same on every stage): each step phase (draft; verify + commit) is captured as one
          CUDA graph: every stage on the target's GPU and greedy (no draws);
        + `graph_buckets`: where steps are not captured, the token counts T of the forwards a step
          runs, each captured once per stage and replayed:
            target  - 1 (autoregressive) and the drafter's tree + root;
            drafter - 2 (catch-up) and the batch sizes of its tree expansion (nodes per depth with
                      children; the width for dynamic trees).
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


@graph_pass(requires=("device", "tree", "tree_nodes"), provides=("static_shapes", "step_graphs", "graph_buckets"))
def capture_graphs(graph: SpecGraph) -> SpecGraph:
    recipe, target = graph.recipe, graph.target
    drafter = graph.drafter_of(target)
    for name in graph.stages():
        graph.node(name)["static_shapes"] = graph.node(name)["device"].type == "cuda" and recipe.lowering.cuda_graphs
    device = graph.node(target)["device"]
    step_graphs = (all(graph.node(n)["static_shapes"] and graph.node(n)["device"] == device for n in graph.stages())
                   and recipe.sampling.temperature == 0)
    for name in graph.stages():
        node = graph.node(name)
        node["step_graphs"] = step_graphs
        if not node["static_shapes"] or step_graphs:
            node["graph_buckets"] = ()
        elif name == target:
            node["graph_buckets"] = tuple(sorted({1} | ({graph.node(drafter)["tree_nodes"] + 1} if drafter else set())))
        else:
            node["graph_buckets"] = tuple(sorted({2} | expansion_sizes(node["tree"])))
    return graph
