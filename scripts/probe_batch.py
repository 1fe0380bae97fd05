"""Do a serial recipe's outputs depend on the batch? fp32, eager layers, the small fixtures, 16 prompts x 128
tokens: the recipe and `ar` at batch 1 and 8 (with and without CUDA graphs), and `autoregressive.yaml` alone at
batch 1, 8 and 4, each through bench's measure_engine; prints, per pair of systems, the prompts whose outputs
agree and the first positions where others part. Run from the repository root (`.fixtures/` as scripts/gpu_setup.sh
says): `python3 scripts/probe_batch.py`. Run 95 (docs/benchmarks.md)."""
import json
import sys
import time

from specgraph.bench.batched import measure_engine
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.recipe import Recipe

prompts = [json.loads(l)["prompt"] for l in open(".fixtures/prompts_code.jsonl")][:16]
FP32 = ["models.target.dtype=float32", "lowering.compile=false", "serving.max_batch=8", "max_new_tokens=128"]

def probe(title, recipe, overrides, runs):
    t = time.time()
    try:
        with Program(plan(Recipe.from_yaml(recipe, [*FP32, *overrides]))) as p:
            enc = [p.encode(x) for x in prompts]
            out = {}
            for name, b in runs:
                engine = p.executor if name != "ar" or recipe.endswith("autoregressive.yaml") else p.autoregressive()
                out[f"{name}{b}"] = measure_engine(engine, enc, 128, b, lambda: None)["outputs"]
        print(title, f"({time.time() - t:.0f} s)")
        for a in out:
            first = {b: [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), None) for u, v in zip(out[a], out[b])] for b in out}
            print("  ", a, {b: (sum(f is None for f in fs), sorted(f for f in fs if f is not None)[:4]) for b, fs in first.items()})
    except Exception as exc:
        print(title, "FAILED", type(exc).__name__, str(exc)[:300])
    sys.stdout.flush()

D = ["models.draft.dtype=float32"]
probe("A graphs", "recipes/dynamic.yaml", D, [("spec", 1), ("spec", 8), ("ar", 1), ("ar", 8)])
probe("B no graphs", "recipes/dynamic.yaml", D + ["lowering.cuda_graphs=false"], [("spec", 1), ("spec", 8), ("ar", 1), ("ar", 8)])
probe("C ar alone, graphs", "recipes/autoregressive.yaml", [], [("ar", 1), ("ar", 8), ("ar", 4)])
