# One-off probe, kept for the record: runs 89-90 in docs/benchmarks.md, which led to the input projections going
# through `kernels.linear` (after that change both variants run the same kernels). From the repository root, with .fixtures/:
#   python3 docs/results/probes/qkv_one_token_ab.py llama-3-8b     # recipes/tree.yaml, its target and 1B drafter
#   python3 docs/results/probes/qkv_one_token_ab.py qwen3.5-9b     # recipes/hybrid.yaml (qkv and the DeltaNet's in_proj)
"""ms per decoded token of the target alone (ar) and of the recipe's tree, with the fused input
projections (attention qkv_proj, a DeltaNet's in_proj) as nn.Linear (cuBLAS: the code as it is) and
through `kernels.linear` (one token: our one-token kernel; 2-16: the tensor-core tiles; more:
cuBLAS), one Program per variant in one process; 8 prompts of prompts_code.jsonl x 128, the
median of 3 passes after a warm-up pass."""
import gc
import json
import statistics
import sys

import torch

from specgraph.program import Program, plan
from specgraph.recipe import Recipe

INPUTS = ("qkv_proj", "in_proj")  # the projections nn.Linear runs today


class ThroughKernels(torch.nn.Module):
    """An nn.Linear's weights projected by its owner's selected `linear` kernel."""

    def __init__(self, linear: torch.nn.Linear, kernels):
        super().__init__()
        self.weight, self.bias, self.kernels = linear.weight, linear.bias, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear(x, self.weight, self.bias)


def route_inputs_through_kernels(model: torch.nn.Module) -> int:
    routed = 0
    for owner in list(model.modules()):
        for name in INPUTS:
            linear = getattr(owner, name, None)
            if isinstance(linear, torch.nn.Linear):
                setattr(owner, name, ThroughKernels(linear, owner.kernels))
                routed += 1
    return routed


def ms_per_token(generate, ids: list[list[int]]) -> float:
    runs = [generate(i, 128) for i in ids]
    return sum(g.seconds - g.first_token_seconds for g in runs) / sum(len(g.output_ids) - 1 for g in runs) * 1e3


shape = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
hybrid = shape.startswith("qwen")
recipe = Recipe.from_yaml("recipes/hybrid.yaml" if hybrid else "recipes/tree.yaml",
                          ["models.target.path=../.fixtures/hybrid"] if hybrid else [])
prompts = [json.loads(line)["prompt"] for line in open(".fixtures/prompts_code.jsonl")][:8]
for variant in ("nn.Linear", "kernels.linear"):
    program = Program(plan(recipe), systems=("ar",), widen=shape)
    if variant == "kernels.linear":
        routed = sum(route_inputs_through_kernels(stage.model) for stage in program.stages.values())
        print(f"routed {routed} projections through kernels.linear", flush=True)
    ar = program.autoregressive()
    ids = [program.encode(p) for p in prompts]
    for i in ids:  # warm-up: compilation and capture
        ar.generate(i, 128)
        program.generate(i, 128)
    ar_ms, tree_ms = [], []
    for _ in range(3):
        ar_ms.append(ms_per_token(ar.generate, ids))
        tree_ms.append(ms_per_token(program.generate, ids))
    print(f"{shape} {variant}: ar {statistics.median(ar_ms):.3f} ms/token {['%.3f' % m for m in ar_ms]}; "
          f"tree {statistics.median(tree_ms):.3f} ms/token {['%.3f' % m for m in tree_ms]}", flush=True)
    del ar, program
    gc.collect()
    torch.cuda.empty_cache()
