# One-off probe, kept for the record: run 62 in docs/benchmarks.md (python3 docs/results/probes/draft_step_profile.py
# OUTDIR [KEY=VALUE ...] (recipe overrides, as --set takes them), from the repository root, with .fixtures/).
"""Every CUDA kernel of one replayed draft step (and one verify step) of the hybrid recipe at the
Qwen3.5-9B shape with its 1B drafter: kernels summed by name, and the whole timeline with gaps
written to OUTDIR/{draft,verify}-timeline.txt."""
import collections
import json
import sys

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from specgraph.program import Program, plan
from specgraph.recipe import Recipe

out, sets = sys.argv[1], ["models.target.path=../.fixtures/hybrid"] + sys.argv[2:]
recipe = Recipe.from_yaml("recipes/hybrid.yaml", sets)
prompts = [json.loads(line) for line in open(".fixtures/prompts_code.jsonl")][:2]
program = Program(plan(recipe), widen="qwen3.5-9b")
tree = program.executor
ids = program.encode(prompts[0]["prompt"])
for _ in range(2):
    g = program.generate(ids, 128)
torch.cuda.synchronize()
g = program.generate(ids, 128)
print(f"tree: {len(g.output_ids)} tokens in {g.target_steps} steps, draft {g.draft_seconds / g.target_steps * 1e3:.3f} "
      f"verify {g.verify_seconds / g.target_steps * 1e3:.3f} ms/step", flush=True)
for name in ("draft", "verify"):
    graph = tree._graphs[name].graph
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    R = 4
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"\n== {name}: {start.elapsed_time(end) / 20 * 1e3:.1f} us per replay (CUDA events, 20 replays)")
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
    lines = []
    for i, e in enumerate(one):
        gap = 0 if prev is None else e.time_range.start - prev
        key = e.name[:80]
        total[key] += e.time_range.elapsed_us()
        count[key] += 1
        gaps[key] += gap
        lines.append(f"{i:4d} {e.time_range.elapsed_us():8.2f} us  gap {gap:6.2f}  {e.name[:160]}")
        prev = e.time_range.end
    for key, us in total.most_common(30):
        print(f"{us:9.1f} us {count[key]:4d}x  gaps before {gaps[key]:7.1f}  {key}")
    with open(f"{out}/{name}-timeline.txt", "w") as f:
        f.write("\n".join(lines) + "\n")
