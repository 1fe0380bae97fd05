"""Step attention (Triton) against PyTorch SDPA with an explicit mask, on a GPU, in one run.

Shapes are Llama-3-8B's (32 query heads, 8 KV heads, head dim 128, bf16, batch 1): a draft tree of
T nodes (random topology) after a committed prefix of P tokens, in a static cache of P + T + 64
slots. Three ways: `sdpa-exact` (SDPA over exactly the P + T used slots, with the [T, P + T] mask:
what an eager forward does), `sdpa-static` (SDPA over the whole cache under the step mask: what a
CUDA-graph-captured forward does) and `triton` (kernels/attention/triton.py, whole-cache mask, reads
slots up to the last written one). Each is timed over 200 CUDA-graph replays; outputs are checked
against sdpa-exact in the same run.

    python3 scripts/bench_attention.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from specgraph.bench.timing import graph_time_us
from specgraph.kernels.attention import attention_reference
from specgraph.kernels.attention.triton import attention
from specgraph.runtime.stage import step_mask
from specgraph.tree import Tree

H, H_KV, K = 32, 8, 128


def case(t: int, prefix: int, generator: torch.Generator) -> dict:
    dev = torch.device("cuda")
    slots_total = prefix + t + 64
    parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, t)]
    tree = Tree(torch.zeros(t, dtype=torch.long), torch.tensor(parents))
    q = torch.randn(1, H, t, K, generator=generator).to(dev, torch.bfloat16)
    k = torch.randn(1, H_KV, slots_total, K, generator=generator).to(dev, torch.bfloat16)
    v = torch.randn(1, H_KV, slots_total, K, generator=generator).to(dev, torch.bfloat16)
    start = torch.tensor(prefix, device=dev)
    ancestors = tree.ancestors.to(dev)
    slots = prefix + torch.arange(t, device=dev)
    exact_mask = step_mask(start, ancestors, prefix + t)  # [T, P + T]
    static_mask = step_mask(start, ancestors, slots_total)  # [T, S]
    ways = {"sdpa-exact": lambda: attention_reference(q, k, v, exact_mask, slots),
            "sdpa-static": lambda: attention_reference(q, k, v, static_mask, slots),
            "triton": lambda: attention(q, k, v, static_mask, slots)}
    expected = ways["sdpa-exact"]().float()
    row = {"nodes": t, "prefix": prefix}
    for name, fn in ways.items():
        row[f"{name}_us"] = graph_time_us(fn)
        row[f"{name}_max_err"] = float((fn().float() - expected).abs().max())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'nodes':>5} {'prefix':>6} | {'sdpa-exact us':>13} {'sdpa-static us':>14} {'triton us':>9} | "
          f"{'exact/triton':>12} {'static/triton':>13} | max err")
    for t in (1, 16, 32, 64, 128):
        for prefix in (256, 1024, 4096, 8192):
            r = case(t, prefix, generator)
            rows.append(r)
            print(f"{t:>5} {prefix:>6} | {r['sdpa-exact_us']:>13.1f} {r['sdpa-static_us']:>14.1f} {r['triton_us']:>9.1f} | "
                  f"{r['sdpa-exact_us'] / r['triton_us']:>11.2f}x {r['sdpa-static_us'] / r['triton_us']:>12.2f}x | "
                  f"{max(r['sdpa-static_max_err'], r['triton_max_err']):.3g}", flush=True)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv)}
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
