"""compile_stages: decide, per stage, whether its step functions are compiled with torch.compile.

Before: stages carry `device`.
After:  + `compile` (bool): `lowering.compile` where the recipe sets it, else True on GPUs (where
        fused kernels pay) and False on the CPU (where a cold compile costs more than it saves).
        Lowering compiles regions (see program.py): each model's decoder layers (once for all
        layers), its stem and logits head; for the target, the placement of a step's tree and the
        verdict, commits and append after its forward.
"""

from __future__ import annotations

from specgraph.graph import SpecGraph
from specgraph.passes.base import graph_pass


@graph_pass(requires=("device",), provides=("compile",))
def compile_stages(graph: SpecGraph) -> SpecGraph:
    wanted = graph.recipe.lowering.compile
    for name in graph.stages():
        node = graph.node(name)
        node["compile"] = node["device"].type == "cuda" if wanted is None else wanted
    return graph
