# Probe for the next GPU session (not run yet: written after 2026-12-02's device time was spent;
# docs/benchmarks.md, runs 66-70, "Noticed in both tune tables"). From the repository root, with .fixtures/:
#   python3 docs/results/probes/verify_steps.py llama-3-8b        # recipes/tree.yaml's target
#   python3 docs/results/probes/verify_steps.py qwen3.5-9b        # recipes/hybrid.yaml's target
"""The target's verification of T = 1..33 tokens (a chain, as `specgraph tune` times it: one CUDA
graph per size, best of 5) with the kernels' row limits as they are and changed, in one process:
  base      FEW_ROWS 16 (17+ tokens on cuBLAS), step attention rows per program up to 64
  few32     FEW_ROWS 32 (17-32 tokens on the tensor-core tiles too)
  attn32    step attention rows per program up to 32 (at 9+ tokens of 4-head groups, two row blocks)
Run 66 and 69 saw verification step up at 17 tokens (both shapes) and at 9 (8B)."""
import json
import statistics
import sys

import specgraph.kernels.attention.triton as attention_triton
import specgraph.kernels.linear.triton as linear_triton
from specgraph.bench.tune import verification_seconds
from specgraph.program import Program, plan, stage_over, verifier_of
from specgraph.recipe import DynamicTree, Recipe

shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
hybrid = shape.startswith("qwen")
recipe = Recipe.from_yaml("recipes/hybrid.yaml" if hybrid else "recipes/tree.yaml",
                          ["models.target.path=../.fixtures/hybrid"] if hybrid else [])
graph = plan(recipe.with_tree(0, DynamicTree(shape="dynamic", width=4, depth=3, nodes=32)))  # caches for 33 tokens
prompts = [json.loads(line)["prompt"] for line in open(".fixtures/prompts_code.jsonl")][:8]
variants = {"base": (16, 64), "few32": (32, 64), "attn32": (16, 32)}
sizes = list(range(1, 34))
with Program(graph, widen=shape) as program:
    encoded = [program.encode(p) for p in prompts]
    position = round(statistics.mean(map(len, encoded))) + 32  # as tune timed it (64 new tokens // 2)
    context = [t for ids in encoded for t in ids][: position - 1 + max(sizes)]
    target = graph.target
    times = {}
    for name, (few_rows, max_block_m) in variants.items():
        linear_triton.FEW_ROWS, attention_triton.MAX_BLOCK_M = few_rows, max_block_m
        timed = {target: stage_over(graph, target, program.stages[target].model)}
        times[name] = verification_seconds(verifier_of(graph, timed), sizes, context, position)
        del timed
        print(f"{name}: " + " ".join(f"{times[name][t] * 1e3:.3f}" for t in sizes), flush=True)  # kept if cut short
print(f"{shape}: verification ms at position {position}, T tokens")
print(f"{'T':>3} " + " ".join(f"{name:>8}" for name in variants))
for t in sizes:
    print(f"{t:3d} " + " ".join(f"{times[name][t] * 1e3:8.3f}" for name in variants))
