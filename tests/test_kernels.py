"""Kernels against their references on odd shapes (the Triton interpreter on the CPU).

Tolerance policy: fp32 inputs 1e-4 absolute; bf16 inputs 2e-2 (outputs rounded to bf16)."""

import pytest
import torch

from specgraph.kernels.tree_attention import pack_ancestors, tree_attention_reference
from specgraph.kernels.tree_attention.triton import tree_attention
from specgraph.tree import Tree

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def random_tree(t: int, generator: torch.Generator) -> Tree:
    parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, t)]
    return Tree(torch.zeros(t, dtype=torch.long), torch.tensor(parents))


def test_pack_ancestors_sets_one_bit_per_ancestor():
    tree = Tree(torch.zeros(4, dtype=torch.long), torch.tensor([-1, 0, 1, 0]))
    assert pack_ancestors(tree.ancestors).tolist() == [0b0001, 0b0011, 0b0111, 0b1001]
    with pytest.raises(ValueError, match="64-bit words"):
        pack_ancestors(torch.eye(65, dtype=torch.bool))


@pytest.mark.parametrize("b, h, hkv, t, d, prefix, dtype", [
    (1, 6, 2, 13, 60, 37, torch.float32),  # odd head dim, GQA 3:1, prefix not a tile multiple
    (2, 4, 4, 1, 64, 70, torch.float32),  # one query (autoregressive), batch 2
    (1, 3, 1, 7, 128, 0, torch.float32),  # empty prefix: the tree alone
    (1, 4, 2, 33, 32, 5, torch.bfloat16),  # more nodes than one 32-key tile
])
def test_tree_attention_matches_reference(b, h, hkv, t, d, prefix, dtype):
    g = torch.Generator().manual_seed(t * 131 + d)
    s = prefix + t + 9  # cache slots, with garbage after the tree
    tree_start = prefix + 3  # a gap of garbage slots between prefix and tree
    q = torch.randn(b, h, t, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, s + 3, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, s + 3, d, generator=g).to(dtype)
    bits = pack_ancestors(random_tree(t, g).ancestors)
    expected = tree_attention_reference(q.float(), k.float(), v.float(), prefix, tree_start, bits)
    got = tree_attention(q, k, v, prefix, tree_start, bits)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - expected).abs().max() < TOL[dtype]
