"""Row-invariant kernels (kernels/*/invariant.py) against the kernels they replace, in one run, at
the Llama-3-8B layer shapes in bf16 on a GPU.

Projections: time (mean over CUDA-graph replays) of our one-token kernel and of cuBLAS at M = 1,
21 and 64 rows, and of the row-invariant projection at M = 1, 21, 64, its default tiling first,
then others; whether every row of an M-row call equals, bit for bit, the same row projected alone.
Attention: a one-token step and a 21-node tree step over a 300- and a 1000-token context (one
request's paged cache of 2048 slots), the split kernel against the invariant one; whether each tree
node's output equals, bit for bit, the same node decoded alone with its path committed at its
positions.

    python scripts/bench_invariant.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import random

import torch
import torch.nn.functional as F

from specgraph.bench.timing import graph_time_us
from specgraph.kernels.attention.invariant import attention_invariant
from specgraph.kernels.attention.triton import attention
from specgraph.kernels.linear.invariant import project_rows, tiling
from specgraph.kernels.linear.triton import linear
from specgraph.layout import Layout, physical
from specgraph.models.widen import SHAPES as WIDE
from specgraph.runtime.stage import BLOCK_SIZE
from specgraph.tree import TreeStructure

SHAPES = WIDE["llama-3-8b"][0].projections()
ROWS = (1, 21, 64)


def rows_match(fn, x: torch.Tensor) -> bool:
    """Whether fn(x) [M, N] equals, row by row and bit for bit, fn of each row alone."""
    whole = fn(x)
    return all(torch.equal(whole[i : i + 1], fn(x[i : i + 1])) for i in range(x.shape[0]))


def projections(device: torch.device) -> list[dict]:
    results = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        xs = {m: torch.randn(m, k, device=device, dtype=torch.bfloat16) for m in ROWS}
        row = {"op": name, "n": n, "k": k, "default_tiling": list(tiling(n, k)),
               "gemv_1_us": graph_time_us(lambda: linear(xs[1][0], w, None)),
               **{f"cublas_{m}_us": graph_time_us(lambda m=m: F.linear(xs[m], w)) for m in ROWS}}
        sweep = []
        for tiles in dict.fromkeys([tiling(n, k), *[(64, block_k, splits) for block_k in (128, 256) for splits in (1, 2, 4)]]):
            if tiles[2] > 1 and k // tiles[2] < tiles[1] * 2:
                continue
            times = {m: graph_time_us(lambda m=m: project_rows(xs[m], w, None, tiles)) for m in ROWS}
            sweep.append({"tiles": tiles, **{f"invariant_{m}_us": t for m, t in times.items()}})
        row["default"] = sweep[0]
        row["rows_bitwise_invariant"] = {m: rows_match(lambda x: project_rows(x, w, None), xs[m]) for m in ROWS[1:]}
        row["cublas_rows_bitwise_invariant"] = {m: rows_match(lambda x: F.linear(x, w), xs[m]) for m in ROWS[1:]}
        whole = F.linear(xs[21], w)  # the default path: cuBLAS for a tree, our one-token kernel alone
        row["default_path_rows_equal_alone"] = sum(torch.equal(whole[i], linear(xs[21][i], w, None)) for i in range(21)) / 21
        row["max_abs_vs_fp32"] = (project_rows(xs[21], w, None).float() - xs[21].float() @ w.float().T).abs().max().item()
        row["sweep"] = sweep
        print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        results.append(row)
    return results


def attention_case(device: torch.device, context: int = 1000, t: int = 21, capacity: int = 2048,
                   heads: tuple[int, int, int] = (32, 8, 128), block_size: int = BLOCK_SIZE) -> dict:
    """One request's step over a paged cache of `capacity` slots whose first `context` are committed:
    a random tree of t nodes (uniform parents, topological order) and its root alone; then each node
    alone, its path committed at its positions. heads: (query heads, KV heads, head dim)."""
    h, h_kv, d = heads
    rng = random.Random(0)
    tree = TreeStructure.of([-1] + [rng.randrange(i) for i in range(1, t)], device)
    anc, depth = tree.ancestors[0], tree.depths[0]  # [T, T] bool (itself included), [T]
    bf16 = dict(device=device, dtype=torch.bfloat16)
    table = torch.arange(1, capacity // block_size + 1, device=device)[None]  # [1, M]: the request's blocks (0: trash)
    k, v = (torch.randn(1, h_kv, (1 + table.numel()) * block_size, d, **bf16) for _ in range(2))  # [1, Hkv, S, D]
    q = torch.randn(1, h, t, d, **bf16)  # [1, H, T, D]

    def attend(start: int, visible: torch.Tensor, positions: torch.Tensor) -> tuple:
        """The kernels' inputs after q, k, v for tokens at region offsets 0.. from virtual slot
        `start`, each seeing the slots below it and the offsets visible [T', T'] marks."""
        offsets = torch.arange(visible.shape[0], device=device)  # [T']
        layout = Layout.single(table, block_size, torch.tensor(start, device=device), offsets, visible, positions,
                               capacity)
        return layout.attention_inputs(h)

    one = torch.ones(1, 1, dtype=torch.bool, device=device)  # [1, 1]: a token that sees itself
    tree_in = attend(context, anc, context + depth)
    one_in = attend(context, one, torch.tensor([context], device=device))
    q1 = q[:, :, :1].contiguous()  # [1, H, 1, D]: the root
    result = {"context": context, "tree_nodes": t, "heads": h, "kv_heads": h_kv, "head_dim": d,
              "split_tree_us": graph_time_us(lambda: attention(q, k, v, *tree_in)),
              "invariant_tree_us": graph_time_us(lambda: attention_invariant(q, k, v, *tree_in)),
              "split_one_us": graph_time_us(lambda: attention(q1, k, v, *one_in)),
              "invariant_one_us": graph_time_us(lambda: attention_invariant(q1, k, v, *one_in))}
    tree_out = attention_invariant(q, k, v, *tree_in)  # [1, H, T, D]
    split_out = attention(q, k, v, *tree_in)
    same_inv, same_split = 0, 0
    for node in range(t):
        path = anc[node].nonzero().flatten()  # [depth + 1]: its region offsets, root first
        src = physical(table, block_size, 0, context + path)
        dst = physical(table, block_size, 0, context + torch.arange(path.numel(), device=device))
        k2, v2 = k.clone(), v.clone()
        k2[:, :, dst], v2[:, :, dst] = k[:, :, src], v[:, :, src]
        p = context + int(depth[node])  # its position: its path committed below it
        alone_in = attend(p, one, torch.tensor([p], device=device))
        qn = q[:, :, node : node + 1].contiguous()  # [1, H, 1, D]
        same_inv += torch.equal(attention_invariant(qn, k2, v2, *alone_in)[:, :, 0], tree_out[:, :, node])
        same_split += torch.equal(attention(qn, k2, v2, *alone_in)[:, :, 0], split_out[:, :, node])
    result["invariant_nodes_bitwise_equal_alone"] = f"{same_inv}/{t}"
    result["split_nodes_bitwise_equal_alone"] = f"{same_split}/{t}"
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(device), "attention": [attention_case(device, c) for c in (300, 1000)],
              "projections": projections(device)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
