"""capture_graphs: plan what each stage replays as CUDA graphs.

Before: stages carry `device` and the tree plan.
After:  + `static_shapes` (bool): forwards attend over the whole cache (shapes depend on T only);
          true where CUDA graphs are on (a GPU, `lowering.cuda_graphs`);
        + `step_graphs` (bool): the stage's step phases are captured, each as one CUDA graph: serial
          execution captures a step's phases (draft; verify + commit), one graph per batch size,
          when every stage is on the target's GPU with static shapes (the same on every stage; each
          request's draws come from its own counter-based stream, which a graph holds);
          asynchronous execution, each stage's own phases where its shapes are static and nothing
          draws (its streams are torch generators);
        + `alone_step_graphs` (bool): a step of the stage decoding alone (the `ar` baseline) is captured
          as CUDA graphs, one per batch size: static shapes;
        + `graph_buckets`: where steps are not captured, the token counts T of the forwards a step
          runs, each captured once per stage and replayed:
            target  - 1 (autoregressive) and the drafter's tree + root;
            drafter - 2 (catch-up) and the batch sizes of its tree expansion (nodes per depth with
                      children; the width for dynamic trees), or for a hybrid drafter, which
                      re-feeds, the catch-up and the nodes fed so far;
            pipeline - every stage's steps run forward by forward: the first stage's catch-ups of
                      1 to `feeds` tokens and its tree's expansions, the others every size up to
                      their `step_tokens`.
        Other sizes (prefill) run eagerly.
"""

from __future__ import annotations

from specgraph.graph import SpecGraph
from specgraph.models.loader import is_hybrid
from specgraph.passes.base import graph_pass
from specgraph.recipe import DynamicTree
from specgraph.tree import Growth


def expansion_sizes(tree, feeds: int, recurrent: bool) -> set[int]:
    """Token counts of a drafter's expansion forwards: each batch of nodes, or, for a recurrent
    (hybrid) drafter, the catch-up and every node fed so far (draft.py)."""
    if isinstance(tree, Growth):
        return {tree.leaves}
    if isinstance(tree, DynamicTree):
        batches = [tree.width] * (tree.depth - 1)
    else:
        batches = [len(tree.expanding(depth)) for depth in range(1, tree.max_depth)]
    return {feeds + sum(batches[: i + 1]) for i in range(len(batches))} if recurrent else set(batches)


@graph_pass(requires=("config", "device", "tree", "tree_nodes", "window", "step_tokens", "feeds"), provides=("static_shapes", "step_graphs", "alone_step_graphs", "graph_buckets"))
def capture_graphs(graph: SpecGraph) -> SpecGraph:
    recipe, target = graph.recipe, graph.target
    drafter = graph.drafter_of(target)
    for name in graph.stages():
        graph.node(name)["static_shapes"] = graph.node(name)["device"].type == "cuda" and recipe.lowering.cuda_graphs
    device = graph.node(target)["device"]
    draws = recipe.sampling.temperature > 0
    together = all(graph.node(n)["static_shapes"] and graph.node(n)["device"] == device for n in graph.stages())
    for name in graph.stages():
        node = graph.node(name)
        # serial: every stage's phases of a step, together; otherwise each stage's own
        phases = together if recipe.execution == "serial" else node["static_shapes"] and recipe.execution != "pipeline"
        node["step_graphs"] = phases and (recipe.execution == "serial" or not draws)
        node["alone_step_graphs"] = node["static_shapes"]
        if not node["static_shapes"] or node["step_graphs"]:
            node["graph_buckets"] = ()
        elif node["window"]:
            node["graph_buckets"] = tuple(range(1, node["step_tokens"] + 1))
        elif name == target:
            node["graph_buckets"] = tuple(sorted({1} | ({graph.node(drafter)["tree_nodes"] + 1} if drafter else set())))
        else:  # (a pipeline's first stage catches up on anything from one token to its `feeds`)
            catch_up = set(range(1, node["feeds"] + 1)) if recipe.execution == "pipeline" else {node["feeds"]}
            expansions = expansion_sizes(node["tree"], node["feeds"], is_hybrid(node["config"]))
            node["graph_buckets"] = tuple(sorted(catch_up | expansions))
    return graph
