# One-off probe, kept for the record: run 76 in docs/benchmarks.md (python3 docs/results/probes/gated_delta_kernel_ab.py
# OLD.py, from the repository root; OLD.py: kernels/gated_delta/triton.py of the commit compared against, e.g.
# `git show 09b970b:specgraph/kernels/gated_delta/triton.py > build/gated_delta_old.py`).
"""The closed-form gated-DeltaNet step, old kernels against the current ones, in one process: microseconds
per call (mean over CUDA-graph replays) of the gates kernel alone and of the whole step, old and new, and
of the walk (kernels/gated_delta/invariant.py, which runs the current gates), at the Qwen3.5-9B and 27B
layer shapes, over chains, bushy and dynamic trees of 1-128 nodes; and the new step's outputs against
the old's (max abs difference over the old's max abs)."""
import sys
import types

import torch

sys.path.insert(0, "scripts")
from bench_gated_delta import SHAPES, layer_inputs  # noqa: E402

from specgraph.bench.timing import graph_time_us  # noqa: E402
from specgraph.bench.widen import QWEN35_REAL  # noqa: E402
from specgraph.kernels.gated_delta import triton as new  # noqa: E402
from specgraph.kernels.gated_delta.invariant import gated_delta_step_invariant  # noqa: E402
from specgraph.tree import Tree  # noqa: E402

source = open(sys.argv[1]).read().replace('"specgraph::gated_delta_', '"specgraph_old::gated_delta_')
old = types.ModuleType("gated_delta_old")
old.__file__ = sys.argv[1]
exec(compile(source, sys.argv[1], "exec"), old.__dict__)


def gates_call(module, args, steps):
    *projections, windows, visible, state = args
    step_k, _, step_decay, step_inputs = steps
    return lambda: module.gates(*projections, windows, visible.contiguous(), state, step_k, step_decay, step_inputs,
                                path=True)


generator = torch.Generator().manual_seed(0)
print(f"{'shape':>11} {'tree':>7} {'T':>3} | {'gates old':>9} {'gates new':>9} | {'step old':>8} {'step new':>8} "
      f"{'old/new':>7} | {'walk':>7} | {'new vs old':>10}")
for shape_name, shape in QWEN35_REAL.items():
    for tree_name, depth in SHAPES.items():
        for t in (1, 16, 32, 64, 128) if tree_name == "chain" else (16, 32, 64, 128):
            tree = Tree.random(t, min(depth or t, t), generator)
            args, steps = layer_inputs(shape, t, tree, generator, torch.device("cuda"))
            ref = old.gated_delta_step(*args, *steps).float()
            got = new.gated_delta_step(*args, *steps).float()
            diff = float((got - ref).abs().max() / ref.abs().max())
            us = {name: graph_time_us(call, replays=200) for name, call in (
                ("gates old", gates_call(old, args, steps)), ("gates new", gates_call(new, args, steps)),
                ("step old", lambda: old.gated_delta_step(*args, *steps)),
                ("step new", lambda: new.gated_delta_step(*args, *steps)),
                ("walk", lambda: gated_delta_step_invariant(*args, *steps)))}
            print(f"{shape_name:>11} {tree_name:>7} {t:>3} | {us['gates old']:>9.1f} {us['gates new']:>9.1f} | "
                  f"{us['step old']:>8.1f} {us['step new']:>8.1f} {us['step old'] / us['step new']:>7.2f} | "
                  f"{us['walk']:>7.1f} | {diff:>10.1e}", flush=True)
