"""A torch profiler trace of steady engine steps, and its summary. Run from the repository root on a GPU
(`.fixtures/` as scripts/gpu_setup.sh says):

  python3 scripts/profile_engine.py RECIPE [--systems specgraph,ar] [--batches 1,8] [--steps 20] [--widen SHAPE]
                                    [--set KEY=VALUE ...] --out DIR

For each system (the recipe's engine, `ar`) and batch size B, in one process: B requests of the first prompts
of prompts_code.jsonl, each long enough to outlast the profiled steps, are decoded untimed until every one is
past its prompt and the graphs of size B are captured; then `--steps` steps are profiled (CPU and CUDA activity). DIR gets `trace-NAME.json.gz` (a Chrome trace) and `summary-NAME.json`
(scripts/trace_summary.py's reading of it; for `ar`, also the floor of its step: the bytes it must read, weights
and each request's context, over the copy bandwidth measured first, and the share of it the step's GPU time
reaches). Diagnostics, not benchmark figures: the profiler slows the host. SPECGRAPH_PDL=0 gives each kernel its
own time (with dependent launches a kernel starts early and waits inside)."""
import argparse
import json
import sys
from pathlib import Path

import torch

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_summary import print_top_kernels, saved  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--systems", default="specgraph,ar")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--widen")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from specgraph.bench.harness import measure_copy_bandwidth
    from specgraph.cli import build_progress
    from specgraph.passes import plan
    from specgraph.program import Program
    from specgraph.recipe import Recipe

    batches = [int(b) for b in args.batches.split(",")]
    prompts = [json.loads(line)["prompt"] for line in open(".fixtures/prompts_code.jsonl")]
    sets = [*args.set, f"serving.max_batch={max(batches)}"]
    with build_progress(), Program(plan(Recipe.from_yaml(args.recipe, sets)), widen=args.widen) as program:
        bandwidth = measure_copy_bandwidth(program.stages[program.graph.target].device) \
            if torch.cuda.is_available() else None
        for system in args.systems.split(","):
            engine = program.executor if system == "specgraph" else program.autoregressive()
            for batch in batches:
                print(f"profiling {system} at batch {batch}", flush=True)
                profile(program, engine, prompts[:batch], args.steps, args.out,
                        f"{Path(args.recipe).stem}-{system}-b{batch}", bandwidth if system == "ar" else None)


def profile(program, engine, prompts: list[str], steps: int, out: Path, name: str, bandwidth: float | None) -> None:
    """`steps` steady steps of `engine` over `prompts` traced; with `bandwidth` (bytes/s), the floor of an
    `ar` step beside its GPU time."""
    budget = 8 * (steps + 40)  # new tokens: more than the warm-up and the profiled steps can take
    requests = [engine.add_request(program.encode(text), budget) for text in prompts]
    for _ in range(30):  # prompts in, graphs of this size captured, compiled code warm
        engine.step()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            with torch.profiler.record_function("engine_step"):
                engine.step()
        sync()
    for request in requests:
        engine.abort(request.id)
    summary = saved(profiler, out, name, steps)
    if bandwidth:
        from specgraph.bench.harness import step_bytes

        weights, states, kv = step_bytes(program)
        context = sum(len(r.prompt) + len(r.generation.output_ids) for r in requests) / len(requests)  # (at the end: an upper bound)
        floor = (weights + len(requests) * (2 * states + kv * context)) / bandwidth
        summary |= {"floor_ms_per_step": 1e3 * floor, "share_of_floor": 1e3 * floor / summary["gpu_span_ms_per_step"]}
    (out / f"summary-{name}.json").write_text(json.dumps(summary, indent=1))
    print(name, json.dumps({k: v for k, v in summary.items() if k != "top_kernels"}), flush=True)
    print_top_kernels(summary)

if __name__ == "__main__":
    main()
