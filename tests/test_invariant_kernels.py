"""The row-invariant kernels (kernels/*/invariant.py; the Triton interpreter on the CPU, fp32):
their results are the references', and a token's row has the bits it has when the token is alone
in its step — a tree node's attention output those of the node decoded alone after its path was
committed at its positions, its gated-DeltaNet output (and the state a commit leaves) those of
one-token steps along its path, whatever trees share its batch and whichever request slot holds
its state. (On a GPU in bf16: tests/test_gpu.py.)"""

import numpy as np
import pytest
import torch
from helpers import gated_delta_layer, one_token_steps, path_alone, random_layout

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
from specgraph.layout import Layout, physical
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
        assert tiling(n, k, 4, interpreted=True)[2] > 1  # (the tiles this run used)


def pool_for(layout: Layout, hkv: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values [1, Hkv, S, K] for every block `layout`'s table can name (block 0 too)."""
    s = (1 + int(layout.table.max())) * layout.block_size
    return torch.randn(1, hkv, s, d, generator=g), torch.randn(1, hkv, s, d, generator=g)


@pytest.mark.parametrize("h, hkv, d, counts, prefixes, dtype", [
    (6, 2, 60, [13, 1], [37, 5], torch.float32),  # odd head dim, GQA 3 (rows of 4 tokens), prefixes not a tile multiple
    (4, 4, 16, [9, 3], [300, 0], torch.float32),  # no GQA (16 tokens a block), several splits, an empty prefix
    (8, 1, 32, [21], [0], torch.float32),  # GQA 8 (2 tokens a block), the tree alone
    (2, 1, 32, [1, 1], [130, 64], torch.float32),  # one token past a split boundary; one at a block boundary
    (8, 2, 64, [6, 1, 3], [200, 90, 0], torch.bfloat16),  # GQA 4; bf16 (the one case not in fp32)
])
def test_invariant_attention_matches_reference_and_gives_each_node_its_bits_alone(h, hkv, d, counts, prefixes, dtype):
    g = torch.Generator().manual_seed(sum(counts) * 7 + d)
    layout = random_layout(counts, prefixes, g, block_size=32)
    q = torch.randn(1, h, layout.tokens, d, generator=g).to(dtype)
    k, v = (x.to(dtype) for x in pool_for(layout, hkv, d, g))
    attend = layout.attention_inputs(q.shape[1])
    got = attention_invariant(q, k, v, *attend)
    assert got.dtype == dtype
    expected = attention_reference(q.float(), k.float(), v.float(), *attend)
    assert (got.float() - expected).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)
    assert not got[:, :, sum(counts):].any()  # padding
    assert got.transpose(1, 2).is_contiguous()  # token-major, as the split kernel's
    torch.library.opcheck(attention_invariant, (q, k, v, *attend), test_utils=("test_faketensor",))
    for token in range(sum(counts)):
        assert torch.equal(got[:, :, token], path_alone(q, k, v, layout, token)), token


def test_invariant_attention_of_a_prefill_chunk_and_of_a_drafters_level():
    """A causal chunk after a prefix (every path contiguous) and a drafter's level, written past
    nodes fed earlier in the same region: both as the reference; the level's nodes with the bits
    of their paths decoded alone (the region's nodes were fed in feed order)."""
    g = torch.Generator().manual_seed(3)
    h, hkv, d = 4, 2, 16
    chunk = random_layout([150], [100], g, block_size=64, chains=True)
    k, v = pool_for(chunk, hkv, d, g)
    q = torch.randn(1, h, chunk.tokens, d, generator=g)
    got = attention_invariant(q, k, v, *chunk.attention_inputs(q.shape[1]))
    assert (got - attention_reference(q, k, v, *chunk.attention_inputs(q.shape[1]))).abs().max() < 1e-5
    visible = torch.zeros(3, 9, dtype=torch.bool)  # committed [0, 40); fed nodes at offsets 0..5; the level at 6..8
    visible[0, [1, 3, 6]] = visible[1, [1, 7]] = visible[2, [4, 5, 8]] = True
    table = (1 + torch.randperm(4, generator=g))[None]  # [1, 4]: 128 virtual slots
    level = Layout.single(table, 32, torch.tensor(40), torch.tensor([6, 7, 8]), visible, torch.tensor([42, 41, 42]), 128)
    k, v = pool_for(level, hkv, d, g)
    got = attention_invariant(q[:, :, :3].contiguous(), k, v, *level.attention_inputs(q.shape[1]))
    assert (got - attention_reference(q[:, :, :3], k, v, *level.attention_inputs(q.shape[1]))).abs().max() < 1e-5
    for token in range(3):
        assert torch.equal(got[:, :, token], path_alone(q[:, :, :3], k, v, level, token)), token


def repacked(q, k, v, layout: Layout, order: list[int], g: torch.Generator) -> tuple:
    """Segments `order` of `layout` packed in that order (then two padding tokens) into a forward
    of their own over a new pool: each request's blocks copied to other blocks (a shuffled table,
    rows in another order, 16 blocks longer: another width), garbage elsewhere -> q, k, v, the
    layout and, for each of its tokens, its index in `layout`."""
    bs, m = layout.block_size, layout.table.shape[1]
    cu, n = layout.cu.tolist(), len(order)
    table = (1 + torch.randperm(n * (m + 16), generator=g)).view(n, m + 16)
    rows = torch.randperm(n, generator=g)
    k2, v2 = (torch.randn(1, x.shape[1], (1 + table.numel()) * bs, x.shape[3], generator=g) for x in (k, v))
    virtual = torch.arange(m * bs)
    for i, r in enumerate(order):
        src, dst = physical(layout.table, bs, layout.rows[r], virtual), physical(table, bs, rows[i], virtual)
        k2[:, :, dst], v2[:, :, dst] = k[:, :, src], v[:, :, src]
    counts = [cu[r + 1] - cu[r] for r in order]
    tokens = [t for r in order for t in range(cu[r], cu[r + 1])]
    index = torch.tensor(tokens + [0, 0])
    region = max(counts)
    assert not layout.visible[tokens, region:].any()
    offsets = torch.cat([torch.arange(c) for c in counts] + [torch.zeros(2, dtype=torch.long)])
    packed = Layout.build(table, bs, rows, layout.starts[order], torch.tensor(counts), offsets,
                          layout.visible[index, :region], layout.positions[index], (m + 16) * bs)
    return q[:, :, index].contiguous(), k2, v2, packed, tokens


@pytest.mark.parametrize("h, hkv, d, counts, prefixes, chains", [
    (6, 2, 60, [9, 1, 4, 1], [37, 200, 0, 130], False),  # GQA 3, trees and one-token segments, several splits
    (4, 1, 32, [6, 17, 2], [300, 64, 129], True),  # GQA 4, chains (prefill chunks) of up to 3 token blocks
])
def test_invariant_attention_gives_a_segment_the_same_bits_alone_and_in_any_pack(h, hkv, d, counts, prefixes, chains):
    """Each segment's outputs are the same bits decoded alone (one segment) and packed with the
    others in other orders, its request's slots in other blocks."""
    g = torch.Generator().manual_seed(sum(counts) + d)
    layout = random_layout(counts, prefixes, g, block_size=32, chains=chains)
    q = torch.randn(1, h, layout.tokens, d, generator=g)
    k, v = pool_for(layout, hkv, d, g)
    got = attention_invariant(q, k, v, *layout.attention_inputs(q.shape[1]))
    segments = list(range(len(counts)))
    for order in [[r] for r in segments] + [segments[::-1], segments[1:] + segments[:1]]:
        q2, k2, v2, packed, tokens = repacked(q, k, v, layout, order, g)
        out = attention_invariant(q2, k2, v2, *packed.attention_inputs(q2.shape[1]))
        assert torch.equal(out[:, :, : len(tokens)], got[:, :, tokens]), order


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
