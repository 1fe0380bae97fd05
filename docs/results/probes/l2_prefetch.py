# One-off probe, kept for the record: run 25 in docs/benchmarks.md (for v in 'off 0' 'spare64 64' ...: python3
# docs/results/probes/l2_prefetch.py NAME SPARE, one process per variant). It ran on f91c802 plus a since-removed variant of
# the step attention whose SPARE_PROGRAMS extra programs issued prefetch.global.L2::evict_last over o_proj's weight.
"""One variant per process: autoregressive ms per token at the Llama-3-8B shape (argv: name, spare programs, qkv)."""
import json, sys, time
import torch
import specgraph.kernels.attention.triton as at
from specgraph.recipe import Recipe
from specgraph.bench.harness import BenchSpec, build_systems, measure_copy_bandwidth
name, spare = sys.argv[1], int(sys.argv[2])
at.SPARE_PROGRAMS = spare
prompts = [json.loads(l) for l in open(".fixtures/prompts_code.jsonl")][:2]
program, _, _ = build_systems(BenchSpec(Recipe.from_yaml("recipes/tree.yaml"), prompts, 128, 1, ("ar",), "llama-3-8b"))
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
print(f"{name}: ar {sorted(ms)[3]:.3f} ms/token {['%.3f' % m for m in ms]} copy {bw:.3f} TB/s tokens {hash(str(outs)) % 10**8}", flush=True)
