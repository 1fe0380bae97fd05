# One-off probe, kept for the record: run 87 in docs/benchmarks.md (python3 docs/results/probes/gate_up_variants.py
# [--json OUT], from the repository root). It measures `project_rows(gated=True)`, which run87-gated-tiles.patch (beside
# it) adds to commit 1e87561; dropped after run 88 (no gain end to end), so it does not run on the code as it stands.
# It ran before the patch's gated tiling rule (BLOCK_N 32, K unsplit at these shapes), when `gated` took tiling(N, K).
"""A drafter's gate/up projection + SwiGLU for a few tokens, at the Llama-3.2-1B and 3B layer shapes
in bf16: cuBLAS then the elementwise SwiGLU kernel, against the tensor-core tiles of
kernels/linear/invariant.py with silu(gate) * up in their epilogue (`project_rows(gated=True)`), its
default tiles and a sweep; µs per call (mean over CUDA-graph replays, weights rotated past L2)."""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specgraph.bench.timing import graph_time_us
from specgraph.kernels.linear.invariant import project_rows, tiling
from specgraph.kernels.swiglu import swiglu_reference
from specgraph.kernels.swiglu.triton import silu_mul_rows

SHAPES = {"1b gate_up": (16384, 2048), "3b gate_up": (16384, 3072), "8b gate_up": (28672, 4096)}
TOKENS = (2, 3, 6, 16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    results = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-256 * 2**20 // (n * k * 2)))  # > 256 MB of weights: none stays in L2
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        turn = iter(range(10**9))

        def rotating(fn):
            return lambda: fn(weights[next(turn) % copies])

        for t in TOKENS:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            expected = swiglu_reference(x.float(), weights[0].float(), None)
            got = project_rows(x, weights[0], None, gated=True).float()
            error = ((got - expected).abs() / expected.abs().clamp(min=1.0)).max().item()
            row = {"shape": name, "tokens": t, "default_tiles": list(tiling(n // 2, k)), "max_rel_error": error,
                   "cublas": graph_time_us(rotating(lambda w: silu_mul_rows(F.linear(x, w)))),
                   "gated": graph_time_us(rotating(lambda w: project_rows(x, w, None, gated=True)))}
            sweep = {}
            for bn in (32, 64):
                for splits in (1, 2, 3, 4):
                    for warps in (4, 8):
                        tiles = (bn, 256, splits)
                        sweep[f"BN{bn} S{splits} w{warps}"] = graph_time_us(
                            rotating(lambda w: project_rows(x, w, None, gated=True, tiles=tiles, num_warps=warps)))
            best = min(sweep, key=sweep.get)
            row["sweep"] = sweep
            print(f"{name:11s} T={t:2d}  cublas+swiglu {row['cublas']:6.2f}  gated tiles {row['gated']:6.2f} "
                  f"(default {row['default_tiles']})  best {best} {sweep[best]:6.2f}  rel err {error:.3g}", flush=True)
            results.append(row)
        del weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
