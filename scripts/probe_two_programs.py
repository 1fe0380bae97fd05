"""Does a program decode alike after another program ran in the same process? On a GPU (fp32, the embedded
pair, tests/test_gpu.py's recipes): unless `fresh` is given, a chain program decodes the two test prompts first;
then a dynamic-tree program of batch 4 decodes them twice each, twice over, and its outputs are compared with
its own `ar`. Extra arguments KEY=VALUE are the second program's `lowering` fields (compile=false,
cuda_graphs=false, ...). Run from the repository root: `python3 scripts/probe_two_programs.py [fresh] [KEY=VALUE ...]`.
A correctness diagnostic (docs/benchmarks.md, runs 99-100)."""
import sys

import yaml

sys.path.insert(0, "tests")
from test_gpu import PROMPTS, on_gpu  # noqa: E402

args = sys.argv[1:]
lowering = {key: yaml.safe_load(value) for key, value in (a.split("=", 1) for a in args if "=" in a)}
if "fresh" not in args:
    chain = on_gpu({"shape": "chain", "length": 4}, max_new_tokens=64)
    [chain.generate(chain.encode(text)) for text in PROMPTS]
program = on_gpu({"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}, max_new_tokens=64, serving={"max_batch": 4},
                 lowering=lowering)
encoded = [program.encode(text) for text in PROMPTS]
runs = [dict(program.generate_many(encoded * 2)) for _ in range(2)]
ar = [program.autoregressive().generate(ids, 64).output_ids for ids in encoded] * 2
for k, run in enumerate(runs):
    got = [run[i].output_ids for i in range(4)]
    parts = [next((i for i, (a, b) in enumerate(zip(u, v)) if a != b), None) for u, v in zip(got, ar)]
    print(" ".join(args) or "after a chain program", f"run {k}:", "agree" if got == ar else f"part at {parts}", flush=True)
