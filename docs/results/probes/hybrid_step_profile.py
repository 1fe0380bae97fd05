# One-off probe, kept for the record: run 54 in docs/benchmarks.md (python3 docs/results/probes/hybrid_step_profile.py
# SHAPE [KEY=VALUE ...] (recipe overrides, as --set takes them), from the repository root, with .fixtures/).
"""Every CUDA kernel of one replayed autoregressive step of the widened hybrid target, with gaps,
and the kernels' time summed by name."""
import collections
import json
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from specgraph.program import Program, plan
from specgraph.recipe import Recipe

shape, sets = sys.argv[1], ["models.target.path=../.fixtures/hybrid"] + sys.argv[2:]
recipe = Recipe.from_yaml("recipes/hybrid.yaml", sets)
prompts = [json.loads(line) for line in open(".fixtures/prompts_code.jsonl")][:1]
program = Program(plan(recipe), systems=("ar",), widen=shape)
ar = program.autoregressive()
ids = program.encode(prompts[0]["prompt"])
ar.generate(ids, 64)
ar.generate(ids, 64)
torch.cuda.synchronize()
for _ in range(2):
    g = ar.generate(ids, 128)
    torch.cuda.synchronize()
    print(f"ar {len(g.output_ids)} tokens, {(g.seconds - g.first_token_seconds) / (len(g.output_ids) - 1) * 1e3:.3f} ms/token")
graph = ar._graphs["verify"].graph
for _ in range(3):
    graph.replay()
torch.cuda.synchronize()
R = 4
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(R):
        graph.replay()
    torch.cuda.synchronize()
ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
n = len(ev) // R
one = ev[n:2 * n]
wall = one[-1].time_range.end - one[0].time_range.start
busy = sum(e.time_range.elapsed_us() for e in one)
print(f"kernels per step {n}; step wall {wall:.1f} us, kernels {busy:.1f} us, gaps {wall - busy:.1f} us")
total, count, gaps = collections.Counter(), collections.Counter(), collections.Counter()
prev = None
for e in one:
    name = e.name[:70]
    total[name] += e.time_range.elapsed_us()
    count[name] += 1
    gaps[name] += 0 if prev is None else e.time_range.start - prev
    prev = e.time_range.end
for name, us in total.most_common(40):
    print(f"{us:9.1f} us {count[name]:4d}x  gaps before {gaps[name]:7.1f}  {name}")
prev = None
for i, e in enumerate(one[:120]):
    gap = 0 if prev is None else e.time_range.start - prev
    print(f"{i:4d} {e.time_range.elapsed_us():8.2f} us  gap {gap:6.2f}  {e.name[:100]}")
    prev = e.time_range.end
