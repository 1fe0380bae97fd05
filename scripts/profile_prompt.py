"""Where a drafter's prompt forward spends its time: a torch profiler trace of the drafter fed prompts as a
serving engine feeds it (`Runner.sync_drafter`: chunk // --prompt-tokens prompts of --prompt-tokens tokens in
one forward of a chunk), at each chunk size given, and the kernels that take the time; beside it the cost the
policy is calibrated with (`calibrate.prompt_token_seconds`: one prompt of a whole chunk). Run from the
repository root on a GPU (`.fixtures/` as scripts/gpu_setup.sh says):

  python3 scripts/profile_prompt.py RECIPE [--chunks 512,2048] [--prompt-tokens 256] [--widen SHAPE]
                                    [--set KEY=VALUE ...] --out DIR

One build (its prefill chunk the largest of --chunks, so that every chunk is a shape it built); DIR gets
`trace-prompt-CHUNK.json.gz` (a Chrome trace) and `summary-prompt-CHUNK.json` (scripts/trace_summary.py's
reading of it, per forward). Diagnostics, not benchmark figures: the profiler slows the host."""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_summary import print_top_kernels, saved  # noqa: E402

FORWARDS = 5  # profiled forwards of each chunk


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--chunks", default="512,2048")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--widen")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from specgraph.cli import build_progress
    from specgraph.engine.calibrate import prompt_token_seconds
    from specgraph.passes import plan
    from specgraph.program import Program
    from specgraph.recipe import Recipe

    chunks = [int(c) for c in args.chunks.split(",")]
    most = max(chunks)
    sets = [*args.set, f"serving.prefill_chunk={most}", f"serving.max_batch={max(1, most // args.prompt_tokens)}"]
    with build_progress(), Program(plan(Recipe.from_yaml(args.recipe, sets)), widen=args.widen) as program:
        runner = program.executor.runner
        for chunk in chunks:
            calibrated = prompt_token_seconds(runner, chunk)
            prompts = max(1, chunk // args.prompt_tokens)
            feed(runner, prompts, args.prompt_tokens, chunk)  # (warm: this shape's first forward)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as profiler:
                for _ in range(FORWARDS):
                    feed(runner, prompts, args.prompt_tokens, chunk)
            summary = saved(profiler, args.out, f"prompt-{chunk}", FORWARDS)  # (per forward)
            (args.out / f"summary-prompt-{chunk}.json").write_text(json.dumps(summary, indent=1))
            print(f"chunk {chunk}: {prompts} prompts of {args.prompt_tokens} tokens, the GPU busy "
                  f"{1e3 * summary['gpu_busy_ms_per_step'] / (prompts * args.prompt_tokens):.2f} us a prompt token "
                  f"(calibrated: {1e6 * calibrated:.2f} us, one prompt of {chunk})",
                  json.dumps({k: v for k, v in summary.items() if k != "top_kernels"}), flush=True)
            print_top_kernels(summary, "forward")


def feed(runner, prompts: int, tokens: int, chunk: int) -> None:
    """The drafter fed `prompts` prompts of `tokens` tokens each (table rows 0 .. prompts - 1), `chunk` a forward."""
    from specgraph.engine.calibrate import borrowed
    from specgraph.tree import CATCH_UP

    with borrowed(runner, prompts, 0), torch.inference_mode():
        lengths = runner.host_lengths[:prompts]
        runner.host_lengths[:prompts] = [tokens + CATCH_UP] * prompts  # (the drafter is fed all but the last CATCH_UP)
        runner.drafted[:prompts] = [0] * prompts
        runner.sync_drafter(list(range(prompts)), chunk)
        runner.host_lengths[:prompts], runner.drafted[:prompts] = lengths, [0] * prompts
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
