"""select_kernels: choose the implementation of each fused op per stage.

Before: stages carry `device` and `compile`.
After:  + `kernels` {op: "triton" | "reference"} for attention, rope_write, linear, add_rmsnorm,
        swiglu, kv_move and accept_greedy. `lowering.kernels`: "reference" or "triton" force one kind everywhere
        (Triton on the CPU runs only under TRITON_INTERPRET=1, for tests); "auto" picks, on a GPU,
        Triton for attention (it reads only the slots a step can see), rope_write (one kernel
        where Inductor makes three: q's rotation, k's rotation and write, v's write), linear (the
        output and down projections of one token in one kernel, without cuBLAS's split-K
        reduction), kv_move and accept_greedy,
        and for add_rmsnorm and swiglu when the stage is not compiled (a compiled stage's
        Inductor fuses them with their neighbours already); on the CPU, the references.
"""

from __future__ import annotations

from specgraph.graph import SpecGraph
from specgraph.kernels import TRITON
from specgraph.passes.base import graph_pass

ELEMENTWISE = ("add_rmsnorm", "swiglu")


@graph_pass(requires=("device", "compile"), provides=("kernels",))
def select_kernels(graph: SpecGraph) -> SpecGraph:
    wanted = graph.recipe.lowering.kernels
    for name in graph.stages():
        node = graph.node(name)
        if wanted != "auto":
            node["kernels"] = dict.fromkeys(TRITON, wanted)
            continue
        gpu = node["device"].type == "cuda"
        node["kernels"] = {op: "triton" if gpu and not (op in ELEMENTWISE and node["compile"]) else "reference"
                           for op in TRITON}
    return graph
