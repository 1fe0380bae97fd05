"""plan_tree: fix the draft-tree plan of every drafting stage.

Before: a drafting stage carries `spec.tree` as written (or None).
After:  + `tree`: what the drafter grows — a TreeTopology (chain and static trees, node by node),
        the DynamicTree spec, or, where the execution is disaggregated and the tree a chain or
        dynamic, a Growth (one tree grown while the target verifies, re-rooted at each
        verdict: growing.py; a chain is a tree of width 1); static trees are grown after each
        verdict there; `tree_nodes` (draft nodes verified per step, the root not counted) and
        `tree_depth` (their depth bound).
        A drafter without a tree gets the default chain of 4; the final target gets tree None, 0 nodes.
        Where the execution is a pipeline, only the first stage drafts (a chain); every stage above it
        gets tree None and + `window` (the most tokens of the stage below it verifies per forward:
        the first stage's tree, where it drafts trees), every stage below the last + `ahead` (the
        tokens it may produce past what the stage above has verified); elsewhere both are None.
        + `feeds` (drafting stages): the most committed tokens one catch-up feeds — 2, or in a
        pipeline's first stage one more per stage (tokens adopted from above), and a verified tree's
        path where it drafts trees; None for the others.
"""

from __future__ import annotations

from specgraph.errors import RecipeError
from specgraph.graph import SpecGraph
from specgraph.models.loader import is_head, is_hybrid
from specgraph.passes.base import graph_pass
from specgraph.recipe import ChainTree, DynamicTree, GrowSpec
from specgraph.recipe import StaticTree as StaticTreeSpec
from specgraph.tree import CATCH_UP, Growth, TreeTopology


@graph_pass(requires=("config", "device"), provides=("tree", "tree_nodes", "tree_depth", "window", "ahead", "feeds"))
def plan_tree(graph: SpecGraph) -> SpecGraph:
    growing = graph.recipe.execution == "disaggregated"
    pipeline = graph.recipe.execution == "pipeline"
    for name in graph.stages():
        node = graph.node(name)
        spec = node["spec"]
        node.update(window=None, ahead=None, feeds=None)
        if name == graph.target or (pipeline and node["index"] > 0):
            node.update(tree=None, tree_nodes=0, tree_depth=0)
            continue
        tree = spec.tree or ChainTree()
        if spec.grow is not None and not (growing and not isinstance(tree, StaticTreeSpec)):
            where = f"stages.{node['index']}.grow"
            if not growing:
                raise RecipeError(f"{where}: a drafter grows while the target verifies only with execution: disaggregated")
            raise RecipeError(f"{where}: a static tree is drafted anew after each verdict; "
                              "grow a chain or a dynamic tree while the target verifies")
        if growing and isinstance(tree, (ChainTree, DynamicTree)):
            if is_hybrid(node["config"]):  # (its forwards would need the nodes fed by earlier ones: draft.py)
                raise RecipeError(f"stages.{node['index']}.model: models.{spec.model} is a hybrid model "
                                  f"({node['config'].architectures[0]}), which drafts under execution: disaggregated "
                                  "only a static tree (tree: {shape: static}), drafted anew after each verdict; "
                                  "chains and dynamic trees grow across verdicts there")
            width, depth, nodes = (1, tree.length, tree.length) if isinstance(tree, ChainTree) else (
                tree.width, tree.depth, tree.nodes)
            grow = spec.grow or GrowSpec()
            leaves = grow.leaves or (width if node["device"].type == "cpu" else max(16, width))  # GPU: ~free
            plan = Growth(width, depth, nodes, max(1, depth - 1) if grow.steps is None else grow.steps, leaves,
                              min(depth, grow.first or 2))
            node.update(tree=plan, tree_nodes=plan.nodes, tree_depth=plan.depth)
        elif isinstance(tree, DynamicTree):
            node.update(tree=tree, tree_nodes=tree.nodes, tree_depth=tree.depth)
        else:
            topo = TreeTopology.from_spec(tree)
            node.update(tree=topo, tree_nodes=topo.nodes, tree_depth=topo.max_depth)
        node["feeds"] = node["tree_depth"] + 1 if is_head(node["config"]) else CATCH_UP  # (head.py: a step's new tokens)
    if pipeline:
        _plan_pipeline(graph)
    return graph


def _plan_pipeline(graph: SpecGraph) -> None:
    """Windows and how far ahead each stage may run (see the module docstring)."""
    stages, settings = graph.stages(), graph.recipe.pipeline
    first = graph.node(stages[0])
    chain = first["tree_nodes"]
    trees = not isinstance(first["spec"].tree or ChainTree(), ChainTree)
    first["feeds"] = len(stages) + (first["tree_depth"] + 1 if trees else 0)
    for below, name in zip(stages, stages[1:]):
        window = graph.node(name)["spec"].verify.window or chain
        graph.node(name)["window"] = window
        graph.node(below)["ahead"] = settings.ahead or (window if settings.synchronous else 2 * window)
