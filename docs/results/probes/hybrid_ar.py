# One-off probe, kept for the record: run 32 in docs/benchmarks.md (python3 docs/results/probes/hybrid_ar.py NAME REPO_ROOT,
# one process per code version, run from that version's folder so that its specgraph is imported).
"""Autoregressive ms per token of the widened hybrid target (argv: name, repo root)."""
import json, sys
import torch
from specgraph.recipe import Recipe
from specgraph.bench.harness import BenchSpec, build_systems, measure_copy_bandwidth
name, root = sys.argv[1], sys.argv[2]
prompts = [json.loads(l) for l in open(f"{root}/.fixtures/prompts_code.jsonl")][:2]
recipe = Recipe.from_yaml(f"{root}/recipes/hybrid.yaml", ["models.target.path=../.fixtures/hybrid"])
program, _, _ = build_systems(BenchSpec(recipe, prompts, 128, 1, ("ar",), "qwen3.5-9b"))
ar = program.autoregressive()
ids = [program.encode(p["prompt"]) for p in prompts]
outs = [ar.generate(i, 128).output_ids for i in ids]
ms = []
for _ in range(3):
    for i, o in zip(ids, outs):
        g = ar.generate(i, 128)
        assert g.output_ids == o
        ms.append((g.seconds - g.first_token_seconds) / (len(g.output_ids) - 1) * 1e3)
bw = measure_copy_bandwidth(torch.device("cuda")) / 1e12
print(f"{name}: hybrid ar {sorted(ms)[3]:.3f} ms/token {['%.3f' % m for m in ms]} copy {bw:.3f} TB/s first {outs[0][:6]}", flush=True)
