# One-off probe, kept for the record: the step profiles of runs 9 and 12 in docs/benchmarks.md (python3 docs/results/probes/step_kernels.py auto, from the repository root, with .fixtures/).
"""Ordered CUDA kernels of one captured autoregressive step at the Llama-3-8B shape (argv[1]: kernels choice)."""
import sys, json, time
import torch
from torch.autograd import DeviceType
from torch.profiler import profile, ProfilerActivity
from specgraph.recipe import Recipe
from specgraph.bench.harness import BenchSpec, build_systems

kernels = sys.argv[1]
recipe = Recipe.from_yaml("recipes/tree.yaml", [f"lowering.kernels={kernels}"])
prompts = [json.loads(l) for l in open(".fixtures/prompts_code.jsonl")][:1]
program, systems, _ = build_systems(BenchSpec(recipe, prompts, 64, 1, ("ar",), "llama-3-8b"))
ar = program.autoregressive()
ids = program.encode(prompts[0]["prompt"])
ar.generate(ids, 64); ar.generate(ids, 64)
torch.cuda.synchronize()
g = ar.generate(ids, 128); torch.cuda.synchronize()
print(f"{kernels}: ar {len(g.output_ids)} tokens, {(g.seconds - g.first_token_seconds) / (len(g.output_ids) - 1) * 1e3:.3f} ms/token (after the first)")
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    ar.generate(ids, 5)
    torch.cuda.synchronize()
ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
print("kernels in 5 tokens:", len(ev))
prev = None
for e in ev[-70:]:
    gap = 0 if prev is None else e.time_range.start - prev
    print(f"{e.time_range.elapsed_us():8.2f} us  gap {gap:7.2f}  {e.name[:110]}")
    prev = e.time_range.end
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))
