"""Do a serial recipe's outputs depend on the batch? fp32, the small fixtures, 16 prompts x 64 tokens (or max_new_tokens=N):
RECIPE (default recipes/autoregressive.yaml) through bench's measure_engine at batch 1, 4 and 8, with
the `--set` overrides given; prints, per batch size, how many prompts agree with batch 1 and the first
positions where others part. Run from the repository root (`.fixtures/` as scripts/gpu_setup.sh says):
`python3 scripts/probe_batch.py [RECIPE] [KEY=VALUE ...]` (SPECGRAPH_PDL=0 in the environment launches
kernels plainly). A correctness diagnostic, not a speed figure (docs/benchmarks.md, runs 95-96)."""
import json
import sys
import time

from specgraph.bench.batched import measure_engine
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.recipe import Recipe

args = sys.argv[1:]
recipe = args.pop(0) if args and args[0].endswith(".yaml") else "recipes/autoregressive.yaml"
prompts = [json.loads(line)["prompt"] for line in open(".fixtures/prompts_code.jsonl")][:16]
fp32 = ["models.target.dtype=float32", "lowering.compile=false", "serving.max_batch=8", "max_new_tokens=64"]
if "autoregressive" not in recipe:
    fp32.append("models.draft.dtype=float32")
began = time.time()
with Program(plan(Recipe.from_yaml(recipe, [*fp32, *args]))) as program:
    encoded = [program.encode(text) for text in prompts]
    tokens = program.recipe.max_new_tokens
    out = {b: measure_engine(program.executor, encoded, tokens, b, lambda: None)["outputs"] for b in (1, 4, 8)}
parts = {b: [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), None) for u, v in zip(out[1], out[b])]
         for b in (4, 8)}
print(recipe, " ".join(args) or "(defaults)", f"({time.time() - began:.0f} s):",
      "; ".join(f"batch {b}: {sum(f is None for f in fs)}/16 as batch 1, first parts {sorted(f for f in fs if f is not None)[:4]}"
                for b, fs in parts.items()))
