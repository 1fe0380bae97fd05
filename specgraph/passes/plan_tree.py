"""plan_tree: fix the draft-tree plan of every drafting stage.

Before: a drafting stage carries `spec.tree` as written (or None).
After:  + `tree`: a TreeTopology (chain and static trees, node by node) or the DynamicTree spec;
        `tree_nodes` (draft nodes verified per step, the root not counted) and `tree_depth`.
        A drafter without a tree gets the default chain of 4; the final target gets tree None, 0 nodes.
"""

from __future__ import annotations

from specgraph.graph import SpecGraph
from specgraph.passes.base import graph_pass
from specgraph.recipe import ChainTree, DynamicTree
from specgraph.tree import TreeTopology


@graph_pass(requires=("config",), provides=("tree", "tree_nodes", "tree_depth"))
def plan_tree(graph: SpecGraph) -> SpecGraph:
    for name in graph.stages():
        node = graph.node(name)
        if name == graph.target:
            node.update(tree=None, tree_nodes=0, tree_depth=0)
            continue
        spec = node["spec"].tree or ChainTree()
        if isinstance(spec, DynamicTree):
            node.update(tree=spec, tree_nodes=spec.nodes, tree_depth=spec.depth)
        else:
            topo = TreeTopology.from_spec(spec)
            node.update(tree=topo, tree_nodes=topo.nodes, tree_depth=topo.max_depth)
    return graph
