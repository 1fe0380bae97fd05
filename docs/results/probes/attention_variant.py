# One-off probe, kept for the record: run 27 in docs/benchmarks.md (python3 docs/results/probes/attention_variant.py NAME FILE,
# one process per variant; FILE a copy of specgraph/kernels/attention/triton.py: f91c802's, and one reading the slots before
# griddepcontrol.wait).
"""One variant per process: autoregressive ms per token at the Llama-3-8B shape with the step attention of argv[2]
(a copy of specgraph/kernels/attention/triton.py) swapped in."""
import json, sys, importlib.util
import torch
import specgraph.kernels.attention.triton as at
from specgraph.recipe import Recipe
from specgraph.bench.harness import BenchSpec, build_systems, measure_copy_bandwidth
name, path = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("variant", path)
source = open(path).read().replace('"specgraph::attention"', '"probe::attention"')
variant = importlib.util.module_from_spec(spec); exec(compile(source, path, "exec"), variant.__dict__)
at.attention = variant.attention
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
print(f"{name}: ar {sorted(ms)[3]:.3f} ms/token {['%.3f' % m for m in ms]} copy {bw:.3f} TB/s first tokens {outs[0][:6]}", flush=True)
