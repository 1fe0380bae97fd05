"""The row-invariant kernels (kernels/*/invariant.py; the Triton interpreter on the CPU, fp32):
their results are the references', and a token's row has the bits it has when the token is alone
in its step — a tree node's attention output those of the node decoded alone after its path was
committed at its positions, its gated-DeltaNet output (and the state a commit leaves) those of
one-token steps along its path, whatever trees share its batch and whichever request slot holds
its state. (On a GPU in bf16: tests/test_gpu.py.)"""

import numpy as np
import pytest
import torch
from helpers import gated_delta_layer, one_token_steps, path_alone, random_tree

from specgraph.kernels.attention import attention_reference
from specgraph.kernels.attention.invariant import attention_invariant
from specgraph.kernels.gated_delta import gated_delta_step_reference
from specgraph.kernels.gated_delta.invariant import gated_delta_commit_invariant, gated_delta_step_invariant
from specgraph.kernels.linear import linear_reference
from specgraph.kernels.linear.invariant import linear_invariant, tiling
from specgraph.kernels.swiglu import swiglu_reference
from specgraph.kernels.norm import rmsnorm_reference
from specgraph.kernels.norm.triton import rmsnorm
from specgraph.kernels.swiglu.invariant import swiglu_invariant
from specgraph.models.hybrid import conv_windows
from specgraph.tree import Tree


@pytest.fixture(autouse=True)
def dot_row_by_row(monkeypatch):
    """The interpreter's tl.dot is numpy's matmul, whose BLAS may round a row by where it sits in the
    tile (a micro-kernel's tail rows take another path; machine dependent). A GPU's MMA rounds each
    row alike, and so does this dot, one row at a time: what is left to test is our kernels' tiles
    and reduction orders."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = [np.matmul(row[..., None, :], b.data, dtype=d.data.dtype) for row in np.moveaxis(a.data, -2, 0)]
        return TensorHandle(np.concatenate(rows, axis=-2) + d.data, d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", dot)


@pytest.mark.parametrize("op, reference", [(linear_invariant, linear_reference), (swiglu_invariant, swiglu_reference)],
                         ids=["linear", "swiglu"])
@pytest.mark.parametrize("rows, k, n, bias", [
    (1, 37, 18, False),  # one token, odd K, fewer outputs than a tile
    (19, 300, 70, True),  # a 32-row block, a bias
    (40, 4200, 64, True),  # K split, the parts summed in order (bias after the sum); 32-row blocks
])
def test_invariant_projection_matches_reference_and_each_row_its_bits_alone(op, reference, rows, k, n, bias):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(rows, k, generator=g)
    weight = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    got = op(x, weight, b)
    expected = reference(x.double(), weight.double(), b.double() if bias else None)
    assert got.shape == expected.shape and (got.double() - expected).abs().max() < 1e-4
    assert all(torch.equal(got[i], op(x[i], weight, b)) for i in range(rows))
    if k == 4200:
        assert tiling(n, k, 4)[2] > 1


@pytest.mark.parametrize("b, h, hkv, t, d, prefix, width", [
    (1, 6, 2, 13, 60, 37, 64),  # odd head dim, GQA 3 (rows of 4 tokens), prefix not a tile multiple
    (2, 4, 4, 9, 16, 300, 600),  # no GQA (16 tokens a block), batch 2, several splits
    (1, 8, 1, 21, 32, 0, 64),  # GQA 8 (2 tokens a block), empty prefix
    (1, 2, 1, 1, 32, 130, 256),  # one token past a split boundary
])
def test_invariant_attention_matches_reference_and_gives_each_node_its_bits_alone(b, h, hkv, t, d, prefix, width):
    g = torch.Generator().manual_seed(t * 7 + d)
    q = torch.randn(b, h, t, d, generator=g)
    k, v = torch.randn(b, hkv, width, d, generator=g), torch.randn(b, hkv, width, d, generator=g)
    mask = step_mask(torch.tensor(prefix), random_tree(t, g).ancestors, width)  # [T, width]
    slots = prefix + torch.arange(t)
    got = attention_invariant(q, k, v, mask, slots)
    assert (got - attention_reference(q, k, v, mask, slots)).abs().max() < 1e-5
    assert got.transpose(1, 2).is_contiguous()  # token-major, as the split kernel's
    torch.library.opcheck(attention_invariant, (q, k, v, mask, slots), test_utils=("test_faketensor",))
    for node in range(t):
        assert torch.equal(got[:, :, node], path_alone(k, v, q, mask, prefix, node))


def test_invariant_attention_of_a_prefill_chunk_and_of_a_drafters_level():
    """A causal chunk after a prefix (every path contiguous) and a drafter's level, whose ancestors
    lie between the committed prefix and the level's slots: both as the reference."""
    g = torch.Generator().manual_seed(3)
    h, hkv, d, width = 4, 2, 16, 320
    k, v = torch.randn(1, hkv, width, d, generator=g), torch.randn(1, hkv, width, d, generator=g)
    q = torch.randn(1, h, 150, d, generator=g)
    causal = torch.ones(150, 150, dtype=torch.bool).tril()
    chunk = step_mask(torch.tensor(100), causal, width), 100 + torch.arange(150)
    got = attention_invariant(q, k, v, *chunk)
    assert (got - attention_reference(q, k, v, *chunk)).abs().max() < 1e-5
    level = torch.zeros(3, width, dtype=torch.bool)  # committed [0, 40); fed nodes at 40..45; the level at 46..48
    level[:, :40] = True
    level[0, [41, 43, 46]] = level[1, [41, 47]] = level[2, [44, 45, 48]] = True
    slots = torch.tensor([46, 47, 48])
    got = attention_invariant(q[:, :, :3].contiguous(), k, v, level, slots)
    assert (got - attention_reference(q[:, :, :3], k, v, level, slots)).abs().max() < 1e-5


@pytest.mark.parametrize("gated", [False, True])
def test_rmsnorm_kernel_matches_reference_row_by_row(gated):
    """Per-head norms (any strides: a chunk of a projection), plain or times silu(gate) — one program a row."""
    g = torch.Generator().manual_seed(0)
    q_gate = torch.randn(3, 5, 2, 2 * 24, generator=g)
    q, weight = q_gate.chunk(2, dim=-1)[0], torch.rand(24, generator=g) + 0.5  # q [3, 5, 2, 24], strided
    gate = (q_gate.chunk(2, dim=-1)[1] * 3,) if gated else ()
    got = rmsnorm(q, weight, 1e-6, *gate)
    assert got.shape == q.shape and (got - rmsnorm_reference(q, weight, 1e-6, *gate)).abs().max() < 1e-5
    assert torch.equal(got[1, 3], rmsnorm(q[1, 3], weight, 1e-6, *(x[1, 3] for x in gate)))
    if gated:  # the gate matters
        assert (got - rmsnorm_reference(q, weight, 1e-6)).abs().max() > 0.1


def root_paths(trees: list[Tree], nodes: list[int]) -> torch.Tensor:
    """[B, P] long: tree b's path from its root to node nodes[b], -1 padded (one -1 past the longest)."""
    paths = [trees[b].ancestors[0, node].nonzero().flatten().tolist() for b, node in enumerate(nodes)]
    width = max(map(len, paths)) + 1
    return torch.tensor([path + [-1] * (width - len(path)) for path in paths])


@pytest.mark.parametrize("trees, h, hk, dk, dv, pool", [
    ([(9, 4), (4, 3)], 4, 2, 16, 48, 3),  # bushy trees (the second padded); two value tiles, the second part masked
    ([(6, 6), (1, 1), (3, 3)], 2, 1, 32, 16, 5),  # chains (every state on chip) and a lone root, padded to 6
])
def test_invariant_gated_delta_gives_each_node_and_commit_the_bits_of_one_token_steps(trees, h, hk, dk, dv, pool):
    trees, args, steps = gated_delta_layer(trees, h, hk, dk, dv, pool, len(trees) + dk)
    rows = args[10]
    got = gated_delta_step_invariant(*args, *steps)
    expected = gated_delta_step_reference(*args, *(x.clone() for x in steps))
    assert got.isfinite().all()  # padding rows too
    committed = {}  # tree -> the one-token steps' state and conv window after its last node
    for b, tree in enumerate(trees):
        assert (got[b, :tree.size] - expected[b, :tree.size]).abs().max() < 1e-4
        for node in range(tree.size):
            path = tree.ancestors[0, node].nonzero().flatten().tolist()  # root first
            outs, state, conv = one_token_steps(args, steps, b, path)
            assert torch.equal(got[b, node], outs[-1]), (b, node)
            if node == tree.size - 1:
                committed[b] = state, conv
    # committing each tree's path to its last node after the step leaves the one-token steps' state, in its slot
    state, window = args[9][None].clone(), args[3][None].clone()
    gated_delta_commit_invariant(state, window, *(x[None] for x in steps),
                                 root_paths(trees, [tree.size - 1 for tree in trees]), rows)
    for b in range(len(trees)):
        assert torch.equal(state[0, rows[b]], committed[b][0]) and torch.equal(window[0, rows[b]], committed[b][1]), b
    others = [slot for slot in range(pool) if slot not in rows.tolist()]
    assert torch.equal(state[0, others], args[9][others]) and torch.equal(window[0, others], args[3][others])


@pytest.mark.parametrize("trees, pool", [
    ([(5, 3), (1, 1), (11, 4)], 5),  # different sizes (padding); the lone root decoded alone (_decode), walked beside
    ([(1, 1), (1, 1), (1, 1)], 4),  # a decoding batch: one token per request
])
def test_invariant_gated_delta_gives_a_tree_the_bits_it_has_alone(trees, pool):
    """A tree's outputs and the state its commit leaves are bit for bit those it gets stepped alone
    (B = 1, no padding), from step row 0 and another request slot than it has in the batch."""
    trees, args, steps = gated_delta_layer(trees, 2, 1, 16, 32, pool, 7)
    inputs, write, decay_input, conv, conv_weight, a_log, dt_bias, _, visible, state, rows = args
    got = gated_delta_step_invariant(*args, *steps)
    expected = gated_delta_step_reference(*args, *(x.clone() for x in steps))
    paths = root_paths(trees, [int(tree.depths[0].argmax()) for tree in trees])  # each tree's deepest path
    committed, window = state[None].clone(), conv[None].clone()
    gated_delta_commit_invariant(committed, window, *(x[None] for x in steps), paths, rows)
    for b, tree in enumerate(trees):
        n = tree.size
        assert (got[b, :n] - expected[b, :n]).abs().max() < 1e-4
        moved = (rows[b : b + 1] + 1) % pool  # the pool rolled by one slot: the tree's state and window there
        seen = visible[b : b + 1, :n, :n]
        alone_steps = tuple(torch.zeros_like(x) for x in steps)
        alone = gated_delta_step_invariant(*(x[b : b + 1, :n] for x in (inputs, write, decay_input)), conv.roll(1, 0),
                                           conv_weight, a_log, dt_bias, conv_windows(seen, conv_weight.shape[-1]), seen,
                                           state.roll(1, 0), moved, *alone_steps)
        assert torch.equal(alone[0], got[b, :n]), b
        alone_state, alone_window = state.roll(1, 0)[None].clone(), conv.roll(1, 0)[None].clone()
        gated_delta_commit_invariant(alone_state, alone_window, *(x[None] for x in alone_steps), paths[b : b + 1],
                                     moved)
        assert torch.equal(alone_state[0, moved[0]], committed[0, rows[b]]), b
        assert torch.equal(alone_window[0, moved[0]], window[0, rows[b]]), b
