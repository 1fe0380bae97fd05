"""Where a drafter's prompt forward spends its time: a torch profiler trace of the forwards that
`calibrate.prompt_token_seconds` times (the drafter fed one prompt chunk), at each chunk size given, and the
kernels that take the time. Run from the repository root on a GPU (`.fixtures/` as scripts/gpu_setup.sh says):

  python3 scripts/profile_prompt.py RECIPE [--chunks 512,2048] [--widen SHAPE] [--set KEY=VALUE ...] --out DIR

One build (its prefill chunk the largest of --chunks, so that every chunk is a shape it built); DIR gets
`trace-prompt-CHUNK.json.gz` (a Chrome trace) and `summary-prompt-CHUNK.json` (scripts/trace_summary.py's
reading of it, per forward). Diagnostics, not benchmark figures: the profiler slows the host."""
import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_summary import summarize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--chunks", default="512,2048")
    parser.add_argument("--widen")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from specgraph.cli import build_progress
    from specgraph.engine.calibrate import TIMINGS, WARMUP, prompt_token_seconds
    from specgraph.passes import plan
    from specgraph.program import Program
    from specgraph.recipe import Recipe

    chunks = [int(c) for c in args.chunks.split(",")]
    sets = [*args.set, f"serving.prefill_chunk={max(chunks)}", "serving.max_batch=1"]
    args.out.mkdir(parents=True, exist_ok=True)
    with build_progress(), Program(plan(Recipe.from_yaml(args.recipe, sets)), widen=args.widen) as program:
        runner = program.executor.runner
        for chunk in chunks:
            prompt_token_seconds(runner, chunk)  # (warm: this chunk's first forward)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as profiler:
                seconds = prompt_token_seconds(runner, chunk)
            raw = args.out / f"trace-prompt-{chunk}.json"
            profiler.export_chrome_trace(str(raw))
            with open(raw, "rb") as source, gzip.open(f"{raw}.gz", "wb", compresslevel=9) as sink:
                shutil.copyfileobj(source, sink)
            raw.unlink()
            summary = summarize(f"{raw}.gz", WARMUP + TIMINGS)  # (per forward)
            (args.out / f"summary-prompt-{chunk}.json").write_text(json.dumps(summary, indent=1))
            print(f"chunk {chunk}: {1e6 * seconds:.2f} us a prompt token (profiled)",
                  json.dumps({k: v for k, v in summary.items() if k != "top_kernels"}), flush=True)
            for row in summary["top_kernels"]:
                print(f"   {row['ms_per_step']:8.3f} ms/forward  {row['calls_per_step']:6.1f}x  {row['name'][:110]}",
                      flush=True)


if __name__ == "__main__":
    main()
