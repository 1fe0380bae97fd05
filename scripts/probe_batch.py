"""Do a serial recipe's outputs depend on the batch, or on another program run before in the process? fp32,
the small fixtures. Run from the repository root (`.fixtures/` as scripts/gpu_setup.sh says):

  python3 scripts/probe_batch.py [RECIPE] [KEY=VALUE ...]
      RECIPE (default recipes/autoregressive.yaml), 16 prompts x 64 tokens (or max_new_tokens=N), through bench's
      measure_engine at batch 1, 4 and 8 with the `--set` overrides given: per batch size, how many prompts agree
      with batch 1 and the first positions where others part (SPECGRAPH_PDL=0 launches kernels plainly).
  python3 scripts/probe_batch.py two-programs [fresh] [KEY=VALUE ...]
      on a GPU, tests/test_gpu.py's recipes: unless `fresh`, a chain program decodes the two test prompts
      first; then a dynamic-tree program of batch 4 (KEY=VALUE: its `lowering` fields) decodes them twice each,
      twice over, compared with its own `ar`.

Correctness diagnostics, not speed figures (docs/benchmarks.md, runs 95-100)."""
import json
import sys
import time

import yaml


def parts(outputs: list[list[int]], reference: list[list[int]]) -> list[int | None]:
    """Per output, the first position where it parts from its reference (None: equal)."""
    return [next((i for i, (a, b) in enumerate(zip(u, v)) if a != b), None) for u, v in zip(outputs, reference)]


def batches(args: list[str]) -> None:
    from specgraph.bench.batched import measure_engine
    from specgraph.passes import plan
    from specgraph.program import Program
    from specgraph.recipe import Recipe

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
    print(recipe, " ".join(args) or "(defaults)", f"({time.time() - began:.0f} s):", "; ".join(
        f"batch {b}: {sum(f is None for f in fs)}/16 as batch 1, first parts {sorted(f for f in fs if f is not None)[:4]}"
        for b, fs in ((b, parts(out[b], out[1])) for b in (4, 8))))


def two_programs(args: list[str]) -> None:
    sys.path.insert(0, "tests")
    from test_gpu import PROMPTS, on_gpu

    lowering = {key: yaml.safe_load(value) for key, value in (a.split("=", 1) for a in args if "=" in a)}
    if "fresh" not in args:
        chain = on_gpu({"shape": "chain", "length": 4}, max_new_tokens=64)
        [chain.generate(chain.encode(text)) for text in PROMPTS]
    program = on_gpu({"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}, max_new_tokens=64,
                     serving={"max_batch": 4}, lowering=lowering)
    encoded = [program.encode(text) for text in PROMPTS]
    runs = [dict(program.generate_many(encoded * 2)) for _ in range(2)]
    ar = [program.autoregressive().generate(ids, 64).output_ids for ids in encoded] * 2
    for k, run in enumerate(runs):
        got = [run[i].output_ids for i in range(4)]
        print(" ".join(args) or "after a chain program", f"run {k}:", "agree" if got == ar else f"part at {parts(got, ar)}",
              flush=True)


if __name__ == "__main__":
    argv = sys.argv[1:]
    two_programs(argv[1:]) if argv[:1] == ["two-programs"] else batches(argv)
