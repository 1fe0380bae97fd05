"""Where the tensor-core tiles of a few rows stop beating cuBLAS: the measurement behind FEW_ROWS
(kernels/linear/triton.py), in bf16 on a GPU.

For each projection of the Llama-3.2-1B drafter and the Llama-3-8B target and each row count
(a draft level at batch B projects B x the tree's width rows), the mean time over CUDA-graph
replays of `project_rows` (the tiles, default tiling) and of cuBLAS (`F.linear`), side by side, and
per shape the most rows up to which the tiles were never slower.

    python scripts/bench_few_rows.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specgraph.bench.timing import graph_time_us
from specgraph.kernels.linear.invariant import project_rows
from specgraph.models.widen import SHAPES as WIDE

SHAPES = {model: WIDE[name][0].projections() for model, name in (("1b", "llama-3.2-1b"), ("8b", "llama-3-8b"))}
ROWS = (2, 4, 8, 16, 24, 32, 48, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    for model, shapes in SHAPES.items():
        for op, (n, k) in shapes.items():
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5  # [N, K]
            xs = {m: torch.randn(m, k, device=device, dtype=torch.bfloat16) for m in ROWS}  # [M, K]
            tiles = {m: graph_time_us(lambda m=m: project_rows(xs[m], w, None)) for m in ROWS}
            cublas = {m: graph_time_us(lambda m=m: F.linear(xs[m], w)) for m in ROWS}
            no_slower = max((m for m in ROWS if all(tiles[r] <= cublas[r] for r in ROWS if r <= m)), default=0)
            row = {"model": model, "op": op, "n": n, "k": k, "tiles_us": tiles, "cublas_us": cublas,
                   "tiles_no_slower_up_to_rows": no_slower}
            print(f"{model} {op:>12} {n}x{k}: " + "  ".join(
                f"{m}: {tiles[m]:.1f}/{cublas[m]:.1f}" for m in ROWS) + f"  (tiles/cuBLAS us; tiles no slower to {no_slower})",
                flush=True)
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "rows": list(ROWS), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
