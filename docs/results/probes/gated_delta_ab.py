# One-off probe, kept for the record: run 56 in docs/benchmarks.md (python3 docs/results/probes/gated_delta_ab.py NAME
# [KEY=VALUE ...] (recipe overrides, as --set takes them), from the repository root, with .fixtures/; one process per
# variant; output: docs/results/run56-gated-delta-ab.txt; run 64 added the draft's ms per step).
"""The widened Qwen3.5-9B hybrid target with the recipe's tree and alone (ar): ms per decoded token
and the tree's verify ms per step, over 8 prompts of prompts_code.jsonl x 128 tokens, 3 repeats."""
import json
import statistics
import sys

import torch

from specgraph.program import Program, plan
from specgraph.recipe import Recipe

name, sets = sys.argv[1], ["models.target.path=../.fixtures/hybrid"] + sys.argv[2:]
recipe = Recipe.from_yaml("recipes/hybrid.yaml", sets)
prompts = [json.loads(line)["prompt"] for line in open(".fixtures/prompts_code.jsonl")][:8]
program = Program(plan(recipe), systems=("ar",), widen="qwen3.5-9b")
ar = program.autoregressive()
ids = [program.encode(p) for p in prompts]
for i in ids:  # warm-up: compilation and capture
    ar.generate(i, 128)
    program.generate(i, 128)
torch.cuda.synchronize()
ar_ms, tree_ms, verify_ms, draft_ms = [], [], [], []
for _ in range(3):
    for make, out in ((ar.generate, ar_ms), (program.generate, tree_ms)):
        runs = [make(i, 128) for i in ids]
        tokens = sum(len(g.output_ids) - 1 for g in runs)
        out.append(sum(g.seconds - g.first_token_seconds for g in runs) / tokens * 1e3)
        if out is tree_ms:
            verify_ms.append(sum(g.verify_seconds for g in runs) / sum(g.target_steps for g in runs) * 1e3)
            draft_ms.append(sum(g.draft_seconds for g in runs) / sum(g.target_steps for g in runs) * 1e3)
print(f"{name}: ar {statistics.median(ar_ms):.3f} ms/token {['%.3f' % m for m in ar_ms]}; "
      f"tree {statistics.median(tree_ms):.3f} ms/token {['%.3f' % m for m in tree_ms]}, "
      f"verify {statistics.median(verify_ms):.3f} ms/step, draft {statistics.median(draft_ms):.3f} ms/step", flush=True)
