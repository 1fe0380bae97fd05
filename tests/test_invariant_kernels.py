"""The row-invariant kernels (kernels/*/invariant.py; the Triton interpreter on the CPU, fp32):
their results are the references', and a token's row has the bits it has when the token is alone
in its step — a tree node's attention output those of the node decoded alone after its path was
committed at its positions, its gated-DeltaNet output (and the state a commit leaves) those of
one-token steps along its path. (On a GPU in bf16: tests/test_gpu.py.)"""

import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import REPO
from helpers import one_token_steps, path_alone, random_tree

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
from specgraph.runtime.stage import step_mask
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


@pytest.mark.parametrize("b, t, h, hk, dk, dv, depth", [
    (1, 9, 4, 2, 16, 48, 4),  # a bushy tree; two value tiles, the second part masked
    (2, 6, 2, 1, 32, 16, 6),  # a chain (every state on chip), batch 2
])
def test_invariant_gated_delta_gives_each_node_and_commit_the_bits_of_one_token_steps(b, t, h, hk, dk, dv, depth):
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_gated_delta import layer_inputs

    from specgraph.bench.widen import QWEN35_REAL
    shape = replace(QWEN35_REAL["qwen3.5-9b"], linear_key_heads=hk, linear_value_heads=h, linear_key_dim=dk,
                    linear_value_dim=dv)
    gen = torch.Generator().manual_seed(t + dk)
    tree = Tree.random(t, depth, gen)
    args, steps = layer_inputs(shape, t, tree, gen, torch.device("cpu"), torch.float32, b, t + 2)
    got = gated_delta_step_invariant(*args, *steps)
    assert (got - gated_delta_step_reference(*args, *(x.clone() for x in steps))).abs().max() < 1e-4
    for node in range(t):
        path = tree.ancestors[node].nonzero().flatten().tolist()  # root first
        outs, state, conv = one_token_steps(args, tuple(x.clone() for x in steps), path)
        assert torch.equal(got[:, node], outs[-1]), node
        if node == t - 1:  # committing the path after the tree step leaves the one-token steps' state
            committed, window = args[9][None].clone(), args[3][None].clone()
            gated_delta_commit_invariant(committed, window, *(x[None] for x in steps), torch.tensor([*path, -1]))
            assert torch.equal(committed[0], state) and torch.equal(window[0], conv)
