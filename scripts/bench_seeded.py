"""Time one verification of R static draft trees by the sampling rule (keyed Gumbel-max: each
node's perturbed argmax, then greedy acceptance) against the greedy rule (the same walk on plain
argmaxes: the difference is what the noise costs) at the Llama-3-8B vocabulary (128256), batch 1,
8 and 32, the tree {shape: static, branching: [3, 2, 1, 1]} (22 nodes) per request, bf16 logits.
Kernels: Triton on a GPU, the references on the CPU. Prints one line per (batch, rule):

    python3 scripts/bench_seeded.py [--top-p 0.95] [--batches 1 8 32] [--iters 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from specgraph.kernels import Kernels
from specgraph.recipe import SamplingSpec, StaticTree, VerifySpec
from specgraph.sampling import SamplingRows
from specgraph.tree import Tree, TreeStructure, TreeTopology
from specgraph.verify import verify

VOCAB = 128256
OPS = ("accept_greedy", "perturbed_top")


def seconds(run, device: torch.device, iters: int) -> float:
    """Mean seconds of run() over `iters` calls, after two."""
    for _ in range(2):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = Kernels.select(dict.fromkeys(OPS, "triton" if device.type == "cuda" else "reference"))
    topology = TreeTopology.from_spec(StaticTree(branching=[3, 2, 1, 1]))
    structure, n = TreeStructure.of(topology.parents, device), len(topology.parents)
    generator = torch.Generator(device).manual_seed(0)
    for batch in args.batches:
        rows = SamplingRows.of([SamplingSpec(temperature=0.8, top_p=args.top_p, seed=s) for s in range(batch)], device)
        logits = (torch.randn(batch * n, VOCAB, device=device, generator=generator) * 3).bfloat16()  # [T, V]
        grid = torch.arange(batch * n, device=device).view(batch, n)  # [R, N + 1]
        segments = torch.arange(batch, device=device).repeat_interleave(n)  # [T]
        positions = 100 + structure.depths[0].repeat(batch) + 1  # [T]
        tokens = torch.randint(VOCAB, (batch, n), device=device, generator=generator)
        parents = torch.tensor(topology.parents, device=device).expand(batch, -1)
        tree = Tree(tokens, parents, structure.expand(batch))
        for rule in ("sampling", "greedy"):
            spec = VerifySpec(rule=rule)

            def run():
                return verify(tree, logits, grid, spec, rows, None, kernels, segments, positions)

            ms = 1e3 * seconds(run, device, args.iters)
            print(f"{device.type} batch {batch:>2} nodes {batch * n:>4} top_p {args.top_p}: {rule:<8} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
