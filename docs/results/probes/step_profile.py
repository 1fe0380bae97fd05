# One-off probe, kept for the record: runs 23-24 in docs/benchmarks.md (python3 docs/results/probes/step_profile.py, from the
# repository root, with .fixtures/).
"""Every CUDA kernel of one replayed autoregressive step graph at the Llama-3-8B shape, with gaps; totals inside/outside layers."""
import sys, json
import torch
from torch.autograd import DeviceType
from torch.profiler import profile, ProfilerActivity
from specgraph.recipe import Recipe
from specgraph.bench.harness import BenchSpec, build_systems

sets = sys.argv[1:]
recipe = Recipe.from_yaml("recipes/tree.yaml", sets)
prompts = [json.loads(l) for l in open(".fixtures/prompts_code.jsonl")][:1]
program, systems, _ = build_systems(BenchSpec(recipe, prompts, 64, 1, ("ar",), "llama-3-8b"))
ar = program.autoregressive()
ids = program.encode(prompts[0]["prompt"])
ar.generate(ids, 64); ar.generate(ids, 64)
torch.cuda.synchronize()
for _ in range(2):
    g = ar.generate(ids, 128); torch.cuda.synchronize()
    print(f"ar {len(g.output_ids)} tokens, {(g.seconds - g.first_token_seconds) / (len(g.output_ids) - 1) * 1e3:.3f} ms/token")
graph = ar._graphs["verify"].graph
for _ in range(3): graph.replay()
torch.cuda.synchronize()
R = 4
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(R): graph.replay()
    torch.cuda.synchronize()
ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
n = len(ev) // R
print("kernels per step:", n, "total", len(ev))
one = ev[n:2 * n]
wall = one[-1].time_range.end - one[0].time_range.start
busy = sum(e.time_range.elapsed_us() for e in one)
print(f"step wall {wall:.1f} us, kernels {busy:.1f} us, gaps {wall - busy:.1f} us")
prev = None
for i, e in enumerate(one):
    gap = 0 if prev is None else e.time_range.start - prev
    print(f"{i:4d} {e.time_range.elapsed_us():8.2f} us  gap {gap:6.2f}  {e.name[:120]}")
    prev = e.time_range.end
