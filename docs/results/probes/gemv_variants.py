# One-off probe, kept for the record: run 20 in docs/benchmarks.md (python3 docs/results/probes/gemv_variants.py, from the
# repository root, with .fixtures/). It ran on commit 4548aa8 plus probe hooks since removed: module variables
# PROBE_BLOCK_N, PROBE_BLOCK_K and PROBE_WARPS in specgraph/kernels/linear/triton.py set the one-token projection's rows
# per program, K step and warps. Run 19 (the same loop) also tried qkv through that projection (worse) and rows 4/8/2.
"""The one-token projection's tile: autoregressive ms per token at the Llama-3-8B shape, each config a fresh program."""
import gc, json, sys, time
import torch
import specgraph.kernels.linear.triton as lt
from specgraph.recipe import Recipe
from specgraph.bench.harness import BenchSpec, build_systems, measure_copy_bandwidth
configs = {"J BN2 BK1024 w4": (2, 1024, 4), "K BN1 BK1024 w4": (1, 1024, 4), "L BN2 BK2048 w4": (2, 2048, 4),
           "M BN2 BK512 w4": (2, 512, 4), "N BN2 BK1024 w2": (2, 1024, 2), "O BN1 BK2048 w4": (1, 2048, 4),
           "P BN2 BK1024 w8": (2, 1024, 8)}
prompts = [json.loads(l) for l in open(".fixtures/prompts_code.jsonl")][:2]
for name, (bn, bk, w) in configs.items():
    lt.PROBE_BLOCK_N, lt.PROBE_BLOCK_K, lt.PROBE_WARPS = bn, bk, w
    t0 = time.time()
    program, _, _ = build_systems(BenchSpec(Recipe.from_yaml("recipes/tree.yaml"), prompts, 128, 1, ("ar",), "llama-3-8b"))
    ar = program.autoregressive()
    ids = [program.encode(p["prompt"]) for p in prompts]
    for i in ids:
        ar.generate(i, 128)
    ms = []
    for _ in range(2):
        for i in ids:
            g = ar.generate(i, 128)
            ms.append((g.seconds - g.first_token_seconds) / (len(g.output_ids) - 1) * 1e3)
    print(f"{name}: ar {sorted(ms)[2]:.3f} ms/token {['%.3f' % m for m in ms]} ({time.time()-t0:.0f}s)", flush=True)
    del program, ar
    gc.collect(); torch.cuda.empty_cache()
print(f"copy bandwidth {measure_copy_bandwidth(torch.device('cuda'))/1e12:.3f} TB/s")
