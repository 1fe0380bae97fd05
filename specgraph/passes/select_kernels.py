"""select_kernels: choose the implementation of each fused op per stage.

Before: stages carry `device`.
After:  + `kernels` {op: "triton" | "invariant" | "reference"} for attention, rope_write, linear,
        add_rmsnorm, rmsnorm (the gated norm of Qwen3.5's DeltaNet layers), swiglu, kv_move,
        accept_greedy, perturbed_top, gated_delta_step and gated_delta_commit.
        `lowering.kernels`: "reference" or "triton" force one kind everywhere (Triton on the CPU runs
        only under TRITON_INTERPRET=1, for tests), or per op where it maps ops to kinds; "auto" picks
        Triton for every op on a GPU — attention reads only the slots a step can see, rope_write is one
        kernel where Inductor makes three (eight with Qwen3.5's per-head norms and partial rotary),
        rmsnorm (the gated norm) one where Inductor makes two, linear projects one token without
        cuBLAS's split-K reduction and 2-16 (a drafter's tree levels) on tensor-core tiles, swiglu
        projects one token on the gate and up rows and stores only silu(gate) * up, the gated-DeltaNet
        step and commit are the walk of invariant.py (one token 6.1 µs against the closed form's 17.4 at
        the Qwen3.5-9B layer shape; the closed form is faster alone from 16 nodes (run 82), the walk
        end to end on the hybrid recipe's 17-token verify steps too (run 80); "triton" names the
        closed form), and our add_rmsnorm beats
        Inductor's inside compiled layers too (docs/benchmarks.md; on Hopper our kernels also launch
        dependently), and the references on the CPU. `lowering.row_invariant` gives the target the
        kernels of ROW_INVARIANT (linear, swiglu, attention and the gated-DeltaNet step and commit from
        kernels/*/invariant.py, the rest row by row; Triton, so on a GPU or TRITON_INTERPRET=1).
"""

from __future__ import annotations

from specgraph.errors import RecipeError
from specgraph.graph import SpecGraph
from specgraph.kernels import ROW_INVARIANT, TRITON, interpreted
from specgraph.passes.base import graph_pass


GATED_DELTA = ("gated_delta_step", "gated_delta_commit")  # a pair: the walk's step_decay is g, the closed form's G


@graph_pass(requires=("device",), provides=("kernels",))
def select_kernels(graph: SpecGraph) -> SpecGraph:
    wanted = graph.recipe.lowering.kernels
    per_op = wanted if isinstance(wanted, dict) else dict.fromkeys(TRITON, wanted)
    for name in graph.stages():
        node = graph.node(name)
        gpu = node["device"].type == "cuda"
        node["kernels"] = {op: _kind(per_op.get(op, "auto"), op, gpu) for op in TRITON}
        asked = {per_op.get(op, "auto") for op in GATED_DELTA} - {"auto"}
        if len(asked) == 1:  # one of the pair named: the other follows it
            node["kernels"].update(dict.fromkeys(GATED_DELTA, asked.pop()))
        if graph.recipe.lowering.row_invariant and name == graph.target:
            node["kernels"].update(ROW_INVARIANT)
        if node["device"].type == "cpu" and set(node["kernels"].values()) != {"reference"} and not interpreted():
            asked = "row_invariant" if graph.recipe.lowering.row_invariant and name == graph.target else "kernels"
            raise RecipeError(f"lowering.{asked}: stage {node['index']} ({name}) is on the CPU, where Triton kernels "
                              "run only under TRITON_INTERPRET=1 (slowly, for tests); use them on a GPU")
    return graph


def _kind(asked: str, op: str, gpu: bool) -> str:
    """An op's kernel kind: as asked; for "auto", Triton on a GPU (the walk for GATED_DELTA) and the
    reference elsewhere."""
    if asked != "auto":
        return asked
    if not gpu:
        return "reference"
    return "invariant" if op in GATED_DELTA else "triton"
