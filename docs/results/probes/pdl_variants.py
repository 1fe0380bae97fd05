# One-off probe, kept for the record: runs 16-17 in docs/benchmarks.md (python3 docs/results/probes/pdl_variants.py [A B C D E F],
# from the repository root, with .fixtures/). It ran on the commit that adds this file plus two probe hooks since removed:
# qkv and gate_up also went through the `linear` op, and specgraph.kernels.linear.triton.GEMV_MAX_ROWS sent projections with
# more output rows than it to cuBLAS (4096: o and down only, the structure that shipped).
"""A/B of programmatic dependent launch and of the one-token Triton projection for qkv/gate_up:
autoregressive ms per token at the Llama-3-8B shape, each config a fresh program (same process)."""
import gc, json, sys, time
import torch
import specgraph.kernels.pdl as pdl
import specgraph.kernels.linear.triton as lt
from specgraph.recipe import Recipe
from specgraph.bench.harness import BenchSpec, build_systems, measure_copy_bandwidth

configs = {  # name: (lowering.kernels, PDL, GEMV_MAX_ROWS)
    "A auto, no PDL, GEMV o/down (run 13)": ("auto", False, 4096),
    "C all triton, PDL, GEMV all": ("triton", True, 1 << 30),
    "B auto, PDL, GEMV o/down": ("auto", True, 4096),
    "E all triton, PDL, GEMV o/down": ("triton", True, 4096),
    "D all triton, no PDL, GEMV all": ("triton", False, 1 << 30),
    "F all triton, no PDL, GEMV o/down": ("triton", False, 4096),
}
only = sys.argv[1:] or [n[0] for n in configs]
prompts = [json.loads(l) for l in open(".fixtures/prompts_code.jsonl")][:2]
out = {}
ref = None
for name in configs:
    if name[0] not in only:
        continue
    kernels, on, rows = configs[name]
    pdl.ENABLED, lt.GEMV_MAX_ROWS = on, rows
    t0 = time.time()
    recipe = Recipe.from_yaml("recipes/tree.yaml", [f"lowering.kernels={kernels}"])
    program, _, _ = build_systems(BenchSpec(recipe, prompts, 128, 1, ("ar",), "llama-3-8b"))
    ar = program.autoregressive()
    ids = [program.encode(p["prompt"]) for p in prompts]
    for i in ids:
        ar.generate(i, 128)
    torch.cuda.synchronize()
    ms, toks = [], []
    for _ in range(2):
        for i in ids:
            g = ar.generate(i, 128)
            ms.append((g.seconds - g.first_token_seconds) / (len(g.output_ids) - 1) * 1e3)
            toks.append(g.output_ids)
    if ref is None:
        ref = toks
    same = sum(a == b for a, b in zip(toks, ref)) / len(ref)
    out[name] = {"ar_ms_per_token": ms, "median": sorted(ms)[len(ms) // 2], "same_tokens_as_first": same,
                 "setup_s": time.time() - t0}
    print(f"{name}: ar {out[name]['median']:.3f} ms/token {['%.3f' % m for m in ms]} same {same} ({time.time()-t0:.0f}s)", flush=True)
    del program, ar
    gc.collect(); torch.cuda.empty_cache()
bw = measure_copy_bandwidth(torch.device("cuda"))
out["copy_bandwidth"] = bw
print(f"copy bandwidth {bw/1e12:.3f} TB/s; bound at 15.05 GB/token: {15.05e9/bw*1e3:.3f} ms/token")
json.dump(out, open("/tmp/pdl.json", "w"), indent=1)
