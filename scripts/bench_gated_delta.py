"""Gated-DeltaNet tree verification three ways, on a GPU, in one run: time, transient memory, accuracy.

One gated-DeltaNet layer step over a tree of T tokens, from the layer's input projections (the
q/k/v channels, b and a) to every node's output, at the Qwen3.5-9B and 27B layer shapes (16 key
heads, 32 or 48 value heads, head dims 128, conv width 4; bf16 activations, fp32 state), batch 1:
  - `triton`: our fused kernel (kernels/gated_delta/triton.py): every node from the one committed
    state in closed form, value-tiled, no per-node state;
  - `torch`: the same closed form in PyTorch (gated_delta_step_reference);
  - `walk`: the row-invariant step (kernels/gated_delta/invariant.py, `lowering.row_invariant`):
    node by node with the one-token recurrence, each program's state slice on chip, a state stored
    where a child does not follow its parent — exactness's price against the closed form;
  - `branch`: branch by branch, what tree systems built for attention do: each node's state copied
    from its parent's and advanced by its token (level by level, every node of a level at once: the
    baseline's best case), each node's output read from its own state.
Trees: chains, bushy trees (depth 3) and dynamic-like trees (random, depth 8), of 16 to 256 nodes
(and the one-token step, T = 1)
(our kernel takes steps of at most 128 tokens, the model's STEP_TOKENS). Time: mean over CUDA-graph
replays. Memory: peak bytes allocated by one call beyond what was allocated before it (outputs
included). Accuracy: each way's outputs against the token-by-token fp32 recurrence run along each
node's path (the branch way is that recurrence, fed the gates of the PyTorch way: the fused kernel
rounds its conv outputs to bf16 on its own, so near a rounding boundary it may round the other way),
max abs difference and least cosine of a node's outputs (all heads), over LAYERS random layers.
Not counted: the commit after each step (ours and the closed form fold the accepted path into the
state, `gated_delta_commit`; branch by branch keeps the leaf's state); each way replays one layer's
buffers, which stay in L2 where they fit (ours and the closed form: the state; branch by branch's
T states spill past 16 nodes), and ours launches dependently (PDL) between replays.

    python3 scripts/bench_gated_delta.py [--json OUT.json] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from specgraph.bench.timing import graph_time_us, peak_bytes
from specgraph.models.widen import QWEN35_REAL
from specgraph.kernels.gated_delta import gated_delta_step_reference
from specgraph.kernels.gated_delta.invariant import gated_delta_step_invariant
from specgraph.kernels.gated_delta.reference import gated_delta_gates
from specgraph.kernels.gated_delta.triton import gated_delta_step
from specgraph.models.hybrid import STEP_TOKENS, conv_windows
from specgraph.tree import Tree

SIZES = (1, 16, 64, 128, 256)
SHAPES = {"chain": None, "bushy": 3, "dynamic": 8}  # tree name -> depth (None: the size)


def layer_inputs(shape, trees: list[Tree], generator: torch.Generator, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, step_tokens: int = 2 * STEP_TOKENS,
                 requests: int | None = None) -> tuple:
    """Random inputs of one layer step over `trees`, one per request, padded to the largest (as
    models/hybrid.GatedDeltaNet passes them, activations in `dtype`), with a pool of `requests`
    slots (default: one per tree) of committed state and conv window, tree b's in slot rows[b] (a
    random choice), and step buffers of `step_tokens` rows per slot (also the kernel tests')."""
    h, hk, dk, dv, kernel = (shape.linear_value_heads, shape.linear_key_heads, shape.linear_key_dim,
                             shape.linear_value_dim, shape.conv_kernel)
    c, b, t = 2 * hk * dk + h * dv, len(trees), max(tree.size for tree in trees)
    n = requests or b
    act = dict(dtype=dtype, device=device)
    projected = torch.randn(b, t, c + 2 * h + 5, generator=generator).to(**act)  # views of one projection's rows
    inputs, write, decay_input = projected[..., :c], projected[..., c:c + h], projected[..., c + h:c + 2 * h]
    conv = torch.randn(n, kernel - 1, c, generator=generator).to(**act)
    conv_weight = (torch.randn(c, 1, kernel, generator=generator) / 2).to(**act)
    # slow decays (g about -0.01 to -0.1 a token), so that long paths and the committed state still count
    a_log, dt_bias = torch.rand(h, generator=generator).to(**act), (torch.randn(h, generator=generator) - 4).to(**act)
    state = (torch.randn(n, h, dk, dv, generator=generator) / 8).to(device)
    rows = torch.randperm(n, generator=generator)[:b].to(device)
    visible = torch.zeros(b, t, t, dtype=torch.bool)  # rows past a tree's size: padding, seeing nothing
    for tree, seen in zip(trees, visible):
        seen[:tree.size, :tree.size] = tree.ancestors[0]
    visible = visible.to(device)
    args = (inputs, write, decay_input, conv, conv_weight, a_log, dt_bias, conv_windows(visible, kernel), visible,
            state, rows)
    f32 = dict(dtype=torch.float32, device=device)
    steps = (torch.zeros(n, step_tokens, h, dk, **f32), torch.zeros(n, step_tokens, h, dv, **f32),
             torch.zeros(n, step_tokens, h, **f32), torch.zeros(n, step_tokens, c, **act))
    return args, steps


def branch_by_branch(args: tuple, levels: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Every node's own state [T, B, H, dk, dv], from its parent's; levels: (nodes, their parents) per depth,
    the root's parent -1 (the committed state). Returns outputs [B, T, H, dv] fp32."""
    inputs, write, decay_input, conv, *weights, windows, _, state, rows = args
    q, k, v, g, beta = gated_delta_gates(inputs, write, decay_input, conv.index_select(0, rows), *weights, windows,
                                         *state.shape[1:])
    state = state.index_select(0, rows)
    t = q.shape[1]
    states = state.new_empty(t, *state.shape)  # the per-node states: the transient memory of this way
    out = v.new_empty(v.shape)
    for nodes, parents in levels:
        parent_states = state[None] if parents is None else states.index_select(0, parents)  # [n, B, H, dk, dv]
        at = (lambda x: x.index_select(1, nodes).transpose(0, 1))  # [B, n, ...] -> [n, B, ...]
        s = parent_states * at(g).exp()[..., None, None]
        delta = (at(v) - torch.einsum("nbhkv,nbhk->nbhv", s, at(k))) * at(beta)[..., None]
        s = s + at(k)[..., None] * delta[..., None, :]
        states.index_copy_(0, nodes, s)
        out.index_copy_(1, nodes, torch.einsum("nbhkv,nbhk->nbhv", s, at(q)).transpose(0, 1))
    return out


def tree_levels(tree: Tree, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    levels = []
    for depth in range(tree.max_depth + 1):
        nodes = (tree.depths[0] == depth).nonzero().flatten()
        parents = None if depth == 0 else tree.parents[0, nodes]
        levels.append((nodes.to(device), None if parents is None else parents.to(device)))
    return levels


def accuracy(got: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """Max abs difference, and least cosine of a node's outputs over all heads, of [B, T, H, dv] outputs."""
    got, exact = got.float(), exact.float()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(2), exact.flatten(2), dim=-1)  # [B, T]: per node
    return float((got - exact).abs().max()), float(cosine.min())


def case(shape_name: str, tree_name: str, t: int, layers: int, generator: torch.Generator) -> dict:
    shape, device = QWEN35_REAL[shape_name], torch.device("cuda")
    tree = Tree.random(t, min(SHAPES[tree_name] or t, t), generator)
    levels = tree_levels(tree, device)
    row = {"shape": shape_name, "tree": tree_name, "nodes": t, "depth": tree.max_depth + 1}
    ways = {"triton": gated_delta_step, "torch": gated_delta_step_reference, "walk": gated_delta_step_invariant}
    if t > STEP_TOKENS:
        del ways["triton"], ways["walk"]
    errors: dict[str, list[tuple[float, float]]] = {name: [] for name in (*ways, "branch")}
    for layer in range(layers):
        args, steps = layer_inputs(shape, [tree], generator, device)
        exact = branch_by_branch(args, levels)
        errors["branch"].append((0.0, 1.0))
        for name, fn in ways.items():
            errors[name].append(accuracy(fn(*args, *steps), exact))
    calls = {name: (lambda fn=fn: fn(*args, *steps)) for name, fn in ways.items()}
    calls["branch"] = lambda: branch_by_branch(args, levels)
    for name, call in calls.items():
        row[f"{name}_us"] = graph_time_us(call, replays=100)
        row[f"{name}_bytes"] = peak_bytes(call)
        row[f"{name}_max_err"] = max(e for e, _ in errors[name])
        row[f"{name}_min_cos"] = min(c for _, c in errors[name])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--layers", type=int, default=2, help="random layers per case, for the accuracy columns")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gated_delta.py needs a CUDA GPU")
    generator = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'shape':>11} {'tree':>7} {'T':>3} {'depth':>5} | {'triton us':>9} {'walk us':>9} {'torch us':>9} {'branch us':>9} | "
          f"{'torch/tri':>9} {'branch/tri':>10} | {'triton MB':>9} {'torch MB':>9} {'branch MB':>9} {'branch/tri':>10} | "
          f"{'triton err':>10} {'cos':>8} | {'torch err':>9} {'cos':>8}")
    for shape_name in QWEN35_REAL:
        for tree_name in SHAPES:
            for t in SIZES if tree_name == "chain" else SIZES[1:]:
                r = case(shape_name, tree_name, t, args.layers, generator)
                rows.append(r)
                tri = "triton_us" in r
                mb = {n: r[f"{n}_bytes"] / 2**20 for n in ("triton", "torch", "branch") if f"{n}_bytes" in r}
                print(f"{shape_name:>11} {tree_name:>7} {t:>3} {r['depth']:>5} | "
                      + (f"{r['triton_us']:>9.1f} {r['walk_us']:>9.1f} " if tri else f"{'-':>9} {'-':>9} ")
                      + f"{r['torch_us']:>9.1f} {r['branch_us']:>9.1f} | "
                      + (f"{r['torch_us'] / r['triton_us']:>9.2f} {r['branch_us'] / r['triton_us']:>10.2f} | " if tri
                         else f"{'-':>9} {'-':>10} | ")
                      + (f"{mb['triton']:>9.2f} " if tri else f"{'-':>9} ") + f"{mb['torch']:>9.2f} {mb['branch']:>9.1f} "
                      + (f"{r['branch_bytes'] / r['triton_bytes']:>10.1f} | " if tri else f"{'-':>10} | ")
                      + (f"{r['triton_max_err']:>10.2e} {r['triton_min_cos']:>8.6f} | " if tri else f"{'-':>10} {'-':>8} | ")
                      + f"{r['torch_max_err']:>9.2e} {r['torch_min_cos']:>8.6f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
