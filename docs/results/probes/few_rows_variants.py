# One-off probe, kept for the record: run 63 in docs/benchmarks.md (python3 docs/results/probes/few_rows_variants.py
# --old DIR --json OUT, from the repository root). It ran on commit 491acb9 plus `project_few` in
# specgraph/kernels/linear/triton.py and a T-row `_gemv_swiglu` (CUDA-core kernels taking every token per weight row,
# dropped after this run: slower than cuBLAS past one token), so it does not run as it stands.
"""Projections of a few tokens (a drafter's tree levels) at real drafter and target layer shapes:
cuBLAS, the row-invariant tile kernel, and `project_few` / the few-token SwiGLU over a sweep of
tiles, µs per call (mean over CUDA-graph replays, weights rotated past L2). Prints, per shape and
token count, each path's time and the best tile; --json writes every measurement.

    python3 docs/results/probes/few_rows_variants.py [--old DIR] [--json out.json]

--old DIR: a checkout whose kernels/{linear,swiglu}/triton.py are measured too (as `old`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch
import torch.nn.functional as F

from specgraph.kernels.linear.invariant import project_rows
from specgraph.kernels.linear.triton import project_few
import triton

from specgraph.kernels.pdl import launch
from specgraph.kernels.swiglu.triton import _gemv_swiglu, silu_mul_rows, swiglu

# name -> (op, N, K): the fused rows as our modules hold them
SHAPES = {"1b qkv": ("linear", 3072, 2048), "1b o": ("linear", 2048, 2048), "1b gate_up": ("swiglu", 16384, 2048),
          "1b down": ("linear", 2048, 8192), "1b logits": ("linear", 128256, 2048),
          "3b qkv": ("linear", 5120, 3072), "3b o": ("linear", 3072, 3072), "3b gate_up": ("swiglu", 16384, 3072),
          "3b down": ("linear", 3072, 8192),
          "8b qkv": ("linear", 6144, 4096), "8b o": ("linear", 4096, 4096), "8b gate_up": ("swiglu", 28672, 4096),
          "8b down": ("linear", 4096, 14336)}
TOKENS = (1, 2, 3, 4, 6, 8, 16)
CALLS = 24


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graph_us(fn, weights: list[torch.Tensor]) -> float:
    """Mean µs of fn(w) over CALLS calls captured in one CUDA graph, cycling through `weights`."""
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * CALLS)


def swiglu_tiled(x: torch.Tensor, w: torch.Tensor, block_k: int, warps: int) -> torch.Tensor:
    t, k = x.shape
    i = w.shape[0] // 2
    out = torch.empty(t, i, dtype=x.dtype, device=x.device)
    _gemv_swiglu[(i,)](x, w, out, out, t, i, k, HAS_BIAS=False, BLOCK_T=triton.next_power_of_2(t), BLOCK_K=block_k,
                       num_warps=warps, **launch(x.device))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old")
    parser.add_argument("--json")
    args = parser.parse_args()
    old = None
    if args.old:
        old = (load(f"{args.old}/specgraph/kernels/linear/triton.py", "old_linear"),
               load(f"{args.old}/specgraph/kernels/swiglu/triton.py", "old_swiglu"))
    dev = torch.device("cuda")
    results = []
    for name, (op, n, k) in SHAPES.items():
        copies = max(2, -(-256 * 2 ** 20 // (n * k * 2)))  # > 256 MB of weights: none stays in L2
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        for t in TOKENS:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            row = {"shape": name, "tokens": t}
            if op == "linear":
                row["cublas"] = graph_us(lambda w: F.linear(x, w), weights)
                row["invariant"] = graph_us(lambda w: project_rows(x, w, None), weights)
                if old and t == 1:
                    row["old"] = graph_us(lambda w: old[0].linear(x, w, None), weights)
                expected = F.linear(x, weights[0]).float()
                sweep = {}
                bts = [1 << (t - 1).bit_length()]
                for bn in (1, 2, 4):
                    for bk in (128, 256, 512, 1024):
                        for warps in (4, 8):
                            if bn * bts[0] * bk > 16384:
                                continue
                            tiles = (bts[0], bn, bk)
                            got = project_few(x, weights[0], None, tiles, num_warps=warps).float()
                            assert (got - expected).abs().max() <= 2e-2 * expected.abs().max(), (name, t, tiles)
                            sweep[f"BN{bn} BK{bk} w{warps}"] = graph_us(
                                lambda w: project_few(x, w, None, tiles, num_warps=warps), weights)
                row["few"] = sweep
                row["default"] = graph_us(lambda w: project_few(x, w, None), weights)
            else:
                row["cublas"] = graph_us(lambda w: silu_mul_rows(F.linear(x, w)), weights)
                row["default"] = graph_us(lambda w: swiglu(x, w, None), weights)
                if old and t == 1:
                    row["old"] = graph_us(lambda w: old[1].swiglu(x, w, None), weights)
                sweep = {}
                for bk in (128, 256, 512, 1024):
                    for warps in (2, 4, 8):
                        if (1 << (t - 1).bit_length()) * bk > 8192:
                            continue
                        sweep[f"BK{bk} w{warps}"] = graph_us(lambda w: swiglu_tiled(x, w, bk, warps), weights)
                row["few"] = sweep
            few = row.get("few", {})
            best = min(few, key=few.get) if few else "-"
            print(f"{name:12s} T={t:2d}  cublas {row['cublas']:7.2f}  default {row['default']:7.2f}"
                  + (f"  invariant {row['invariant']:7.2f}" if "invariant" in row else "")
                  + (f"  old {row['old']:7.2f}" if "old" in row else "")
                  + (f"  best {best} {few[best]:7.2f}" if few else ""), flush=True)
            results.append(row)
        del weights
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
