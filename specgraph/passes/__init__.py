"""The pass pipeline, read top to bottom. Each pass is a pure function SpecGraph -> SpecGraph."""

from __future__ import annotations

from typing import Callable

from specgraph.graph import SpecGraph
from specgraph.passes.base import Pass
from specgraph.passes.capture_graphs import capture_graphs
from specgraph.passes.compile_stages import compile_stages
from specgraph.passes.place import place
from specgraph.passes.plan_memory import plan_memory
from specgraph.passes.plan_tree import plan_tree
from specgraph.passes.select_kernels import select_kernels
from specgraph.passes.validate import validate
from specgraph.recipe import Recipe

PIPELINE = [
    validate,        # checkpoints readable, tokenizers shared, rules consistent, execution runnable
    place,           # devices and dtypes resolved
    plan_tree,       # draft-tree topology and node budget per drafter
    plan_memory,     # cache slots and byte counts per stage
    compile_stages,  # whose decoder layers torch.compile lowers
    select_kernels,  # Triton or reference implementation of each fused op, per stage
    capture_graphs,  # which forward sizes each stage replays as CUDA graphs
]


def run_pipeline(graph: SpecGraph, after_each: Callable[[Pass, SpecGraph], None] | None = None) -> SpecGraph:
    """Run every pass in order; `after_each(graph_pass, graph)` sees the graph after each one."""
    for graph_pass in PIPELINE:
        graph = graph_pass(graph)
        if after_each is not None:
            after_each(graph_pass, graph)
    return graph


def plan(recipe: Recipe) -> SpecGraph:
    """Recipe -> graph -> every pass of PIPELINE."""
    return run_pipeline(SpecGraph.from_recipe(recipe))
