"""select_kernels: choose the implementation of each fused op per stage.

Before: stages carry `device` and `compile`.
After:  + `kernels` {op: "triton" | "reference"} for each op of `Kernels`. `lowering.kernels`:
        "reference" or "triton" force one kind everywhere (Triton on the CPU runs only under
        TRITON_INTERPRET=1, for tests); "auto" picks, on a GPU, Triton for every op (attention reads
        only the slots a step can see; rope_write is one kernel where Inductor makes three; the
        projections of one token read their weights at HBM speed with the op before them fused in)
        except add_rmsnorm in a compiled stage, which Inductor fuses as well; on the CPU, the references.
"""

from __future__ import annotations

from specgraph.graph import SpecGraph
from specgraph.kernels import TRITON
from specgraph.passes.base import graph_pass

INDUCTOR_FUSES = ("add_rmsnorm",)  # as well as our kernel, where the stage is compiled


@graph_pass(requires=("device", "compile"), provides=("kernels",))
def select_kernels(graph: SpecGraph) -> SpecGraph:
    wanted = graph.recipe.lowering.kernels
    for name in graph.stages():
        node = graph.node(name)
        if wanted != "auto":
            node["kernels"] = dict.fromkeys(TRITON, wanted)
            continue
        gpu = node["device"].type == "cuda"
        node["kernels"] = {op: "triton" if gpu and not (op in INDUCTOR_FUSES and node["compile"]) else "reference"
                           for op in TRITON}
    return graph
