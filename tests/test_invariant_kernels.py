"""The row-invariant kernels (kernels/*/invariant.py; the Triton interpreter on the CPU, fp32):
their results are the references', and a token's row has the bits it has when the token is alone
in its step — a tree node's attention output those of the node decoded alone after its path was
committed at its positions. (On a GPU in bf16: tests/test_gpu.py.)"""

import pytest
import torch
from helpers import path_alone, random_tree

from specgraph.kernels.attention import attention_reference
from specgraph.kernels.attention.invariant import attention_invariant
from specgraph.kernels.linear import linear_reference
from specgraph.kernels.linear.invariant import linear_invariant, tiling
from specgraph.kernels.swiglu import swiglu_reference
from specgraph.kernels.swiglu.invariant import swiglu_invariant
from specgraph.runtime.stage import step_mask


@pytest.mark.parametrize("op, reference", [(linear_invariant, linear_reference), (swiglu_invariant, swiglu_reference)],
                         ids=["linear", "swiglu"])
@pytest.mark.parametrize("rows, k, n, bias", [
    (1, 37, 18, False),  # one token, odd K, fewer outputs than a tile
    (19, 300, 70, True),  # two row blocks, a bias
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
