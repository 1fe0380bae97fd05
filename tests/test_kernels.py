"""Kernels against their references on odd shapes (the Triton interpreter on the CPU).

Tolerance policy: fp32 inputs 1e-4 absolute; bf16 inputs 2e-2 relative to max(1, |reference|), about
two bf16 ulps (outputs are rounded to bf16, and the interpreter truncates fp32 -> bf16 casts where
a GPU rounds to nearest); the gated-DeltaNet step, whose outputs are small, relative to the largest
reference output (1e-4 fp32, 2e-2 bf16)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import gated_delta_layer, random_layout, random_tree

from specgraph.kernels.accept import accept_greedy_reference
from specgraph.kernels.accept.triton import accept_greedy
from specgraph.kernels.attention import attention_reference
from specgraph.kernels.attention.triton import attention
from specgraph.kernels.gated_delta import gated_delta_commit_reference, gated_delta_tree_reference
from specgraph.kernels.gumbel import perturbed_top_reference
from specgraph.kernels.gumbel.triton import perturbed_top
from specgraph.kernels.kv_move import kv_move_reference
from specgraph.kernels.kv_move.triton import kv_move
from specgraph.kernels.linear import linear_reference
from specgraph.kernels.linear import triton as linear_triton
from specgraph.kernels.linear.invariant import project_rows
from specgraph.kernels.linear.triton import linear
from specgraph.kernels.norm import add_rmsnorm_reference
from specgraph.kernels.norm.triton import add_rmsnorm
from specgraph.kernels.qlinear import qlinear_reference
from specgraph.kernels.qlinear.invariant import qlinear_invariant
from specgraph.kernels.qlinear.triton import MAX_ROWS, dequantized, qlinear
from specgraph.kernels.rope import rope_write_reference
from specgraph.kernels.rope import triton as rope_triton
from specgraph.kernels.rope.triton import rope_write
from specgraph.kernels.swiglu import swiglu_reference
from specgraph.kernels.swiglu.triton import swiglu
from specgraph.quant.linear import QuantLinear, dequantize, pack
from specgraph.tree import Tree, TreeStructure

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def close(got: torch.Tensor, expected: torch.Tensor, slack: float = 1.0) -> bool:
    scale = expected.float().abs().clamp(min=1.0)
    return got.dtype == expected.dtype and bool(((got.float() - expected.float()).abs()
                                                 <= slack * TOL[got.dtype] * scale).all())


@pytest.mark.parametrize("h, hkv, d, counts, prefixes, chains, dtype", [
    (6, 2, 60, [13, 1, 5, 1], [37, 70, 0, 5], False, torch.float32),  # odd head dim, GQA 3: trees and one-token segments
    (4, 4, 64, [1, 1, 1, 1, 1], [600, 3, 1100, 64, 290], False, torch.float32),  # autoregressive decoding of five, 4 splits
    (8, 2, 32, [40, 7], [100, 0], True, torch.bfloat16),  # prefill chunks (chains), GQA 4: rows past one row block
    (4, 1, 48, [33, 2, 1], [5, 700, 0], False, torch.bfloat16),  # a 33-node tree (more than a key tile), 2 splits
])
def test_step_attention_matches_reference(h, hkv, d, counts, prefixes, chains, dtype):
    g = torch.Generator().manual_seed(sum(counts) * 131 + d)
    layout = random_layout(counts, prefixes, g, block_size=64 if chains else 32, chains=chains)
    s = (1 + layout.table.numel()) * layout.block_size  # the pool; every slot no segment sees is garbage
    q = torch.randn(1, h, layout.tokens, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, s, d, generator=g).to(dtype)
    attend = layout.attention_inputs(h)
    expected = attention_reference(q.float(), k.float(), v.float(), *attend)
    got = attention(q, k, v, *attend)
    assert not attend[7].any()  # the split programs' tickets left zero for the next layer
    assert got.dtype == dtype and got.shape == q.shape
    assert got.transpose(1, 2).is_contiguous()  # token-major: the output projection reads it without a copy
    torch.library.opcheck(attention, (q, k, v, *attend), test_utils=("test_faketensor",))  # compiled: the same layout
    assert (got.float() - expected).abs().max() < TOL[dtype]
    assert not got[:, :, sum(counts):].any()  # padding


def test_step_attention_needs_blocks_of_whole_key_tiles():
    layout = random_layout([3], [10], torch.Generator().manual_seed(0), block_size=16)
    q, k = torch.randn(1, 2, layout.tokens, 16), torch.randn(1, 2, (1 + layout.table.numel()) * 16, 16)
    with pytest.raises(ValueError, match="multiple of 32, not 16"):
        attention(q, k, k, *layout.attention_inputs(2))


@pytest.mark.parametrize("b, t, h, hkv, d, rotary, norms, dtype", [
    (1, 1, 6, 2, 60, 60, False, torch.float32),  # one token, odd half head dim (30), GQA 3:1
    (2, 5, 3, 3, 32, 32, False, torch.float32),  # batch 2, several tokens, as many KV heads as query heads
    (1, 7, 4, 1, 128, 128, False, torch.bfloat16),
    (1, 1, 4, 2, 48, 12, True, torch.float32),  # Qwen3.5's attention: per-head norms, a quarter of each head rotated
    (2, 6, 2, 1, 64, 16, True, torch.bfloat16),
    (1, 3, 2, 2, 40, 40, True, torch.float32),  # Qwen3's: per-head norms, whole heads rotated
    (2, 20, 10, 2, 32, 32, False, torch.float32),  # a prompt chunk (40 tokens): blocks of 8 heads, the last part empty
    (1, 33, 3, 1, 64, 16, True, torch.bfloat16),  # a chunk with norms, fewer heads than a block
])
@pytest.mark.parametrize("tokens", [1, 16], ids=["a token a program", "16 tokens a program"])  # (a GPU's; the CPU's)
def test_rope_write_matches_reference(b, t, h, hkv, d, rotary, norms, dtype, tokens, monkeypatch):
    monkeypatch.setattr(rope_triton, "INTERPRETED_TOKENS", tokens)
    g = torch.Generator().manual_seed(t * 7 + d)
    qkv = torch.randn(b, t, (2 * h + 2 * hkv) * d, generator=g).to(dtype)  # the projection's output
    q_gate, k, v = qkv.split([2 * h * d, hkv * d, hkv * d], dim=-1)
    q = q_gate.view(b, t, h, 2 * d)[..., :d]  # a strided view, as Qwen3.5's q beside its gate
    k, v = (x.view(b, t, -1, d) for x in (k, v))
    angles = torch.randn(b, 1, t, rotary // 2, generator=g).repeat(1, 1, 1, 2) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    weights = tuple((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2)) + (1e-6,) if norms else ()
    slots = torch.randperm(t + 4, generator=g)[:t]  # anywhere in the cache, out of order
    caches = [torch.randn(b, hkv, t + 4, d, generator=g).to(dtype) for _ in range(2)]
    expected_keys, expected_values = (c.clone() for c in caches)
    expected = rope_write_reference(q, k, v, cos, sin, expected_keys, expected_values, slots, *weights)
    got = rope_write(q, k, v, cos, sin, *caches, slots, *weights)
    slack = 2 if norms and dtype == torch.bfloat16 else 1  # (Triton's interpreter truncates to bf16: twice the roundings)
    assert got.shape == (b, h, t, d) and close(got, expected, slack)
    assert close(caches[0], expected_keys, slack) and torch.equal(caches[1], expected_values)
    if norms:  # the norms matter: without them the heads differ
        assert not close(got, rope_write_reference(q, k, v, cos, sin, *(c.clone() for c in caches), slots))


@pytest.mark.parametrize("rows, c, dtype", [(1, 37, torch.float32), (5, 300, torch.float32), (3, 129, torch.bfloat16)])
def test_add_rmsnorm_matches_reference(rows, c, dtype):
    g = torch.Generator().manual_seed(c)
    x, delta = (torch.randn(1, rows, c, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(c, generator=g).to(dtype)
    total, normed = add_rmsnorm(x, delta, weight, 1e-5)
    ref_total, ref_normed = add_rmsnorm_reference(x, delta, weight, 1e-5)
    assert close(total, ref_total) and close(normed, ref_normed)


@pytest.mark.parametrize("tokens, i, k, bias, dtype", [
    (1, 37, 70, False, torch.float32),  # one token: the projection kernel, odd sizes
    (1, 300, 1500, True, torch.float32),  # one token, K past one tile, bias
    (1, 33, 200, False, torch.bfloat16),
    (4, 65, 48, True, torch.float32),  # several tokens: projection, then the elementwise kernel
    (3, 65, 130, False, torch.bfloat16),
])
def test_swiglu_matches_reference(tokens, i, k, bias, dtype):
    g = torch.Generator().manual_seed(i + k)
    x = torch.randn(1, tokens, k, generator=g).to(dtype)
    weight = (torch.randn(2 * i, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(2 * i, generator=g).to(dtype) if bias else None
    got, expected = swiglu(x, weight, b), swiglu_reference(x, weight, b)
    tol = {torch.float32: 1e-4, torch.bfloat16: 4e-2}[dtype]  # bf16: four roundings (gate, up, silu, product)
    assert got.shape == (1, tokens, i) and got.dtype == dtype
    assert ((got.float() - expected.float()).abs() <= tol * expected.float().abs().clamp(min=1.0)).all()


@pytest.mark.parametrize("shape, moves", [((2, 1, 3, 20, 24), ([7, 9, 12], [5, 6, 7])),  # rows shift down
                                          ((1, 2, 1, 9, 33), ([4, 5, 8, 8], [4, 5, 6, 7]))])  # in place, then a repeat
def test_kv_move_matches_reference(shape, moves):
    cache = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    src, dst = (torch.tensor(x) for x in moves)
    expected = cache.clone()
    kv_move_reference(expected, src, dst)
    kv_move(cache, src, dst)
    assert torch.equal(cache, expected)


def tree_batch(sizes: list[int], g: torch.Generator, shared: bool = False) -> tuple[Tree, list[list[int]]]:
    """R = len(sizes) random trees padded to N + 1 = max(sizes) node slots, as verification gets them:
    padding slots are children of the root in no child table (their tokens, -1, are the caller's);
    `shared`: one tree's shape in every row, its structure expanded (rows of stride 0), as a static
    tree's. Also each tree's parents on the host. Tokens 0."""
    r, n = len(sizes), max(sizes)
    if shared:
        one = random_tree(n, g)
        return Tree(torch.zeros(r, n, dtype=torch.long), one.parents.expand(r, -1),
                    one.structure.expand(r)), [one.parents[0].tolist()] * r
    host = [random_tree(s, g).parents[0].tolist() for s in sizes]
    parents = torch.tensor([p + [0] * (n - len(p)) for p in host])
    alone = [TreeStructure.of(p, "cpu") for p in host]
    max_depth, width = max(s.max_depth for s in alone), max(s.child_table.shape[2] for s in alone)
    shape = TreeStructure.of_parents(parents, max_depth, width)
    structure = TreeStructure.on_device(parents, shape.depths, shape.ancestors, max_depth, width, torch.tensor(sizes))
    return Tree(torch.zeros(r, n, dtype=torch.long), parents, structure, torch.tensor(sizes)), host


def host_depths(parents: list[int]) -> list[int]:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def greedy_drafts(parents: list[int], best: list[int], accept: int, ties: bool, vocab: int,
                  g: torch.Generator) -> list[int]:
    """Tokens of one tree's nodes (the root's 0) such that exactly `accept` drafts along the path to
    its first deepest node are the target's argmax `best` at their parents; other nodes' first
    children match at random (also under mismatched ancestors), their siblings never. `ties`: the
    sibling after each matching path node carries the same token (outside verification's contract,
    which has siblings distinct): several paths match."""
    depth = host_depths(parents)
    path = [depth.index(max(depth))]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    path.reverse()  # root first
    tokens = [0] * len(parents)
    for node in range(len(parents)):
        kids = [c for c in range(len(parents)) if parents[c] == node]
        if node in path[:accept]:
            rank = kids.index(path[path.index(node) + 1])
            hits = set(kids[rank : rank + 2 if ties else rank + 1])
        elif node == path[accept] or not kids:
            hits = set()
        else:
            hits = {kids[0]} if int(torch.randint(0, 2, (), generator=g)) else set()
        for rank, kid in enumerate(kids):
            tokens[kid] = best[node] if kid in hits else (best[node] + 1 + rank) % vocab
    return tokens


def greedy_on_the_host(parents: list[int], tokens: list[int], best: list[int]) -> tuple[list[int], int]:
    """The oracle: the deepest node (the lowest index of equals) whose root path's every draft is the
    target's argmax at its parent -> that path, root first, and the argmax at the node."""
    depth, matched = host_depths(parents), [True] * len(parents)
    for i in range(1, len(parents)):
        matched[i] = matched[parents[i]] and tokens[i] == best[parents[i]]
    last = max((i for i in range(len(parents)) if matched[i]), key=lambda i: (depth[i], -i))
    path = [last]
    while path[-1] > 0:
        path.append(parents[path[-1]])
    return path[::-1], best[last]


@pytest.mark.parametrize("sizes, shared", [([1, 6, 3], False), ([23, 1, 9, 40], False), ([12, 12, 12], True)])
def test_greedy_acceptance_matches_reference(sizes, shared):
    """A batch of trees, one trial per depth: row r accepts exactly min(trial, its depth) drafts
    (greedy_drafts), so every tree gives paths of every depth, and again with ties. The reference
    gives what a walk on the host gives (padding included: it matches nothing), the kernel exactly
    what the reference gives."""
    g = torch.Generator().manual_seed(sum(sizes))
    tree, host = tree_batch(sizes, g, shared)
    vocab, r, n = 64, len(sizes), max(sizes)
    deepest = [max(host_depths(p)) for p in host]
    for trial in range(max(deepest) + 1):
        for ties in (False, True):
            best = torch.randint(0, vocab, (r, n), generator=g)  # the target's argmax at each node
            tokens = torch.full((r, n), -1)  # padding matches nothing
            for row, parents in enumerate(host):
                drafts = greedy_drafts(parents, best[row].tolist(), min(trial, deepest[row]), ties, vocab, g)
                tokens[row, : len(parents)] = torch.tensor(drafts)
            args = (tokens, tree.parents, tree.ancestors, tree.depths, best, tree.max_depth)
            ref_path, ref_bonus = accept_greedy_reference(*args)
            for row, parents in enumerate(host):
                path, bonus = greedy_on_the_host(parents, tokens[row].tolist(), best[row].tolist())
                assert ref_path[row].tolist() == path + [-1] * (tree.max_depth + 1 - len(path))
                assert int(ref_bonus[row]) == bonus and (ties or len(path) == 1 + min(trial, deepest[row]))
            path, bonus = accept_greedy(*args)
            assert torch.equal(path, ref_path) and torch.equal(bonus, ref_bonus)
    torch.library.opcheck(accept_greedy, args, test_utils=("test_faketensor",))


@pytest.mark.parametrize("rows, k, n, bias, dtype", [
    (1, 37, 19, False, torch.float32),  # one token: the matrix-vector kernel, odd sizes
    (1, 300, 70, True, torch.float32),  # a bias; K under one step of 1024
    (1, 1100, 33, False, torch.bfloat16),  # K past one step of 1024
    (2, 37, 19, True, torch.float32),  # a few tokens: the tensor-core tiles of invariant.py
    (16, 1100, 70, True, torch.float32),  # FEW_ROWS; K split, bias added with the splits (fp32: the
    #                                       interpreter's bf16 tl.dot is wrong; bf16 runs in tests/test_gpu.py)
    (17, 37, 19, True, torch.float32),  # more: cuBLAS
])
def test_projection_matches_reference(rows, k, n, bias, dtype, monkeypatch):
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(1, rows, k, generator=g).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    tiled = []
    monkeypatch.setattr(linear_triton, "project_rows", lambda *args: tiled.append(args) or project_rows(*args))
    got = linear(x, weight, b)
    assert got.shape == (1, rows, n) and close(got, linear_reference(x, weight, b))
    assert len(tiled) == (2 <= rows <= linear_triton.FEW_ROWS)  # the path its row count chooses


@pytest.mark.parametrize("rows, k, n, bias, strided", [(1, 37, 19, False, False), (4, 384, 3072, True, False),
                                                      (256, 96, 70, True, True)])
def test_the_cpu_reference_projection_is_the_fp64_product_up_to_fp32_rounding(rows, k, n, bias, strided):
    """linear_reference in fp32 on the CPU, under inference_mode (oneDNN's products) and with gradients
    (F.linear's), for a bias or none, a transposed input and a weight of every other column (a shard's view)."""
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(1, k, rows, generator=g).transpose(1, 2) if strided else torch.randn(1, rows, k, generator=g)
    weight = (torch.randn(n, 2 * k, generator=g)[:, ::2] if strided else torch.randn(n, k, generator=g)) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())  # [1, rows, n]
    with torch.inference_mode():
        served = linear_reference(x, weight, b)
    for got in (served, linear_reference(x, weight, b)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


def sequential_gated_delta(q, k, v, g, beta, state, parents):
    """The gated delta rule token by token, each node from its parent's state -> outputs, states."""
    outs, states = [], []
    for i, parent in enumerate(parents):
        s = state if parent < 0 else states[parent]
        s = s * g[:, i].exp()[..., None, None]
        delta = (v[:, i] - torch.einsum("bhkv,bhk->bhv", s, k[:, i])) * beta[:, i, :, None]
        s = s + k[:, i, :, :, None] * delta[:, :, None, :]
        states.append(s)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, i]))
    return torch.stack(outs, 1), states


def padded_trees(trees: list[Tree]) -> torch.Tensor:
    """visible [B, T, T] of trees padded to the largest: rows past a tree's size see nothing."""
    t = max(tree.size for tree in trees)
    visible = torch.zeros(len(trees), t, t, dtype=torch.bool)
    for tree, seen in zip(trees, visible):
        seen[:tree.size, :tree.size] = tree.ancestors[0]
    return visible


@pytest.mark.parametrize("sizes, h, dk, dv, kernel", [([1], 1, 4, 4, 4), ([13, 5, 1], 3, 5, 7, 4),
                                                      ([63, 40], 2, 60, 33, 2)])
def test_gated_delta_tree_and_commit_match_the_recurrence(sizes, h, dk, dv, kernel):
    """Each tree of a padded batch (its state in a slot of a larger pool) against the recurrence
    token by token; committing the path to its last node leaves that node's state, and the conv
    window ends with the path's inputs."""
    gen = torch.Generator().manual_seed(sum(sizes))
    trees = [random_tree(t, gen) for t in sizes]
    visible = padded_trees(trees)
    (b, t, _), n, s, c = visible.shape, len(sizes) + 2, max(sizes) + 3, 3 * dk
    q = torch.randn(b, t, h, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v, state = torch.randn(b, t, h, dv, generator=gen), torch.randn(n, h, dk, dv, generator=gen)
    g, beta = -torch.rand(b, t, h, generator=gen) * 2, torch.rand(b, t, h, generator=gen)
    rows = torch.randperm(n, generator=gen)[:b]
    out, u, decay = gated_delta_tree_reference(q, k, v, g, beta, state[rows], visible)
    assert out.isfinite().all()  # padding rows too
    conv, step_inputs = torch.randn(1, n, kernel - 1, c, generator=gen), torch.randn(1, n, s, c, generator=gen)
    step_k, step_u, step_decay = (torch.zeros(1, n, s, *x.shape[2:]) for x in (k, u, decay))
    step_k[0, :b, :t], step_u[0, :b, :t], step_decay[0, :b, :t] = k, u, decay
    paths = torch.full((b, t + 2), -1)
    committed, window = state[None].clone(), conv.clone()
    leaves = []
    for i, tree in enumerate(trees):
        one = (x[i : i + 1, :tree.size] for x in (q, k, v, g, beta))
        expected, states = sequential_gated_delta(*one, state[rows[i]][None], tree.parents[0].tolist())
        assert (out[i, :tree.size] - expected[0]).abs().max() < 1e-4
        path = tree.ancestors[0, -1].nonzero().flatten()  # root first, to the last node
        paths[i, :path.numel()] = path
        leaves.append((states[-1][0], torch.cat([conv[0, rows[i]], step_inputs[0, i, path]])[-(kernel - 1):]))
    gated_delta_commit_reference(committed, window, step_k, step_u, step_decay, step_inputs, paths, rows)
    for i, (leaf, leaf_window) in enumerate(leaves):
        assert (committed[0, rows[i]] - leaf).abs().max() < 1e-4 and torch.equal(window[0, rows[i]], leaf_window)
    others = [slot for slot in range(n) if slot not in rows.tolist()]
    assert torch.equal(committed[0, others], state[others]) and torch.equal(window[:, others], conv[:, others])


@pytest.mark.parametrize("trees, pool, h, hk, dk, dv, dtype", [
    ([(1, 1)] * 3, 5, 4, 2, 64, 64, torch.float32),  # one-token steps (autoregressive decoding) of three requests
    ([(13, 5), (6, 3)], 4, 3, 1, 48, 40, torch.float32),  # odd head dims, 3 value heads per key head, padding
    ([(64, 64), (17, 17)], 3, 2, 2, 64, 64, torch.float32),  # chains of 64 and 17 (prompt chunks): padding blocks
    ([(37, 6), (20, 4)], 2, 2, 1, 128, 64, torch.bfloat16),  # bushy trees, head dim 128
    ([(128, 16)], 2, 2, 2, 64, 128, torch.bfloat16),  # the largest step, depth 16
])
def test_gated_delta_step_matches_reference(trees, pool, h, hk, dk, dv, dtype):
    from specgraph.kernels.gated_delta import gated_delta_step_reference
    from specgraph.kernels.gated_delta.triton import gated_delta_step
    trees, args, steps = gated_delta_layer(trees, h, hk, dk, dv, pool, trees[0][0] + dk, dtype, spare=3)
    (b, t), real = args[0].shape[:2], args[8].diagonal(dim1=1, dim2=2)  # [B, T]: nodes (the rest padding)
    expected_steps, got_steps = [x.clone() for x in steps], [x.clone() for x in steps]
    expected = gated_delta_step_reference(*args, *expected_steps)
    got = gated_delta_step(*args, *got_steps)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: outputs rounded, factors from rounded activations
    assert got.dtype == dtype and got.float().isfinite().all()  # padding rows too
    assert (got[real].float() - expected[real].float()).abs().max() <= tol * expected[real].float().abs().max()
    for name, x, y in zip(("k", "u", "G"), got_steps, expected_steps):
        assert (x[:b, :t][real] - y[:b, :t][real]).abs().max() <= tol * y.abs().max(), name
        assert x.isfinite().all() and torch.equal(x[b:], y[b:]) and torch.equal(x[:, t:], y[:, t:]), name  # untouched
    assert torch.equal(got_steps[3][:b, :t], args[0])  # the inputs kept
    assert torch.equal(got_steps[3], expected_steps[3])


def test_gated_delta_step_solves_an_ill_conditioned_chain_as_accurately_as_substitution():
    """A chain of 48 nearly equal keys (cosine > 0.999), write strengths near 1 and almost no decay:
    (I + A) is far from the identity, and the kernel's diagonal-block inverses (block formulas, not
    substitution) must still give U and the outputs to fp32 accuracy — against the same system solved
    in float64, within 10x the error of fp32 forward substitution (the reference)."""
    from specgraph.kernels.gated_delta import gated_delta_step_reference
    from specgraph.kernels.gated_delta.reference import gated_delta_gates
    from specgraph.kernels.gated_delta.triton import gated_delta_step
    h, dk, t = 2, 32, 48
    _, args, steps = gated_delta_layer([(t, t)], h, 1, dk, dk, 2, 1, spare=0)
    gen = torch.Generator().manual_seed(2)
    inputs, write, decay_input, conv, conv_weight, a_log, dt_bias, windows, visible, state, rows = args
    key = slice(dk, 2 * dk)  # the key channels, after the query's
    common = torch.randn(dk, generator=gen)
    inputs[..., key] = common + 0.01 * torch.randn(t, dk, generator=gen)
    conv[..., key] = common + 0.01 * torch.randn(conv.shape[1], dk, generator=gen)
    conv_weight[key] = conv_weight[key].abs()
    write.fill_(8.0)  # beta 0.9997
    decay_input.fill_(-10.0)  # g about -5e-6
    q, k, v, g, beta = gated_delta_gates(inputs, write, decay_input, conv[rows], conv_weight, a_log, dt_bias, windows,
                                         h, dk, dk)
    assert (k[0, :, 0] @ k[0, :, 0].T).min() > 0.999
    exact, exact_u, _ = gated_delta_tree_reference(*(x.double() for x in (q, k, v, g, beta, state[rows])), visible)
    got_steps, ref_steps = [x.clone() for x in steps], [x.clone() for x in steps]
    got, ref = gated_delta_step(*args, *got_steps), gated_delta_step_reference(*args, *ref_steps)

    def error(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.double() - y).abs().max() / y.abs().max())

    for ours, substitution, exact_value in ((got, ref, exact), (got_steps[1][:1, :t], ref_steps[1][:1, :t], exact_u)):
        assert error(ours, exact_value) <= max(10 * error(substitution, exact_value), 1e-6)
        assert error(ours, exact_value) < 1e-5


@pytest.mark.parametrize("layers, pool, h, dk, dv, kernel, paths", [
    (2, 3, 3, 64, 64, 4, [[0], [0]]),  # the roots alone (an autoregressive step) of two requests
    (1, 4, 2, 48, 40, 4, [[0, 2, 5, -1, -1], [0, 1, -1, -1, -1]]),  # padded paths of three and two
    (3, 2, 2, 64, 128, 4, [list(range(18))]),  # past one 16-row tile
    (1, 1, 2, 32, 32, 2, [[0, 3]]),  # a conv of width 2
    (1, 3, 2, 32, 32, 4, [[-1, -1, -1], [0, 1, 4]]),  # nothing to fold (a drafter's first step after a one-token
])  #                                                    prompt) beside a path
def test_gated_delta_commit_matches_reference(layers, pool, h, dk, dv, kernel, paths):
    from specgraph.kernels.gated_delta.triton import gated_delta_commit
    gen = torch.Generator().manual_seed(len(paths[0]) + dk)
    s, c = 20, 3 * dk
    state = torch.randn(layers, pool, h, dk, dv, generator=gen)
    conv = torch.randn(layers, pool, kernel - 1, c, generator=gen)
    factors = (torch.nn.functional.normalize(torch.randn(layers, pool, s, h, dk, generator=gen), dim=-1),
               torch.randn(layers, pool, s, h, dv, generator=gen),
               -torch.rand(layers, pool, s, h, generator=gen).cumsum(2),
               torch.randn(layers, pool, s, c, generator=gen))  # step rows: one per request slot, as in the cache
    paths = torch.tensor(paths)
    rows = torch.randperm(pool, generator=gen)[:paths.shape[0]]
    expected_state, expected_conv = state.clone(), conv.clone()
    gated_delta_commit_reference(expected_state, expected_conv, *factors, paths, rows)
    gated_delta_commit(state, conv, *factors, paths, rows)
    assert (state - expected_state).abs().max() < 1e-4
    assert torch.equal(conv, expected_conv)


def random_quantized(n: int, k: int, format: str, group: int, generator) -> QuantLinear:
    layer = QuantLinear(k, n, True, format, group)
    if format == "fp8":
        layer.weight.copy_(torch.randn(n, k, generator=generator).to(torch.float8_e4m3fn).view(torch.uint8))
    else:
        top = 15 if format == "int4" else 255
        layer.weight.copy_(pack(torch.randint(0, top + 1, (n, k), generator=generator), 4 if format == "int4" else 8))
        layer.zeros.copy_(torch.randint(0, top + 1, layer.zeros.shape, generator=generator))
    layer.scales.copy_(torch.rand(layer.scales.shape, generator=generator) / 50 + 1e-3)
    layer.bias.data.copy_(torch.randn(n, generator=generator))
    return layer


@pytest.mark.parametrize("format, group, n, k", [("int4", 32, 72, 256), ("int4", 128, 40, 384), ("int8", 64, 24, 256),
                                                 ("fp8", 512, 56, 512), ("int4", 512, 8, 512), ("int8", 384, 16, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_projection_kernels_match_the_reference_and_keep_rows_invariant(format, group, n, k, dtype):
    g = torch.Generator().manual_seed(n + k)
    layer = random_quantized(n, k, format, group, g)
    args = (layer.weight, layer.scales.to(dtype), layer.zeros, layer.bias.data.to(dtype), format, group)
    past = MAX_ROWS[format] + 6  # past qlinear's tiles for the format (the invariant kernel's still)
    x = torch.randn(past, k, generator=g).to(dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for rows in (1, 5, 17, MAX_ROWS[format], past):
        expected = qlinear_reference(x[:rows].float(), *(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                                         else a for a in args))
        for kernel in (qlinear, qlinear_invariant) if rows <= MAX_ROWS[format] else (qlinear_invariant,):
            got = kernel(x[:rows], *args)
            assert got.dtype == dtype and got.shape == (rows, n)
            assert ((got.float() - expected).abs() / expected.abs().clamp(min=1)).max() < tolerance, (kernel, rows)
    # past its tiles, qlinear projects the reference's weight (dequantized in one kernel) as the reference does: the
    # same bits in fp32 (and in bf16 on a GPU: tests/test_gpu.py); in bf16 the interpreter's fp32 -> bf16
    # conversion truncates where a GPU rounds to nearest: each weight within its last bit
    if dtype == torch.float32:
        assert torch.equal(qlinear(x, *args), qlinear_reference(x, *args))
    weight = dequantized(layer.weight, args[1], layer.zeros, format, group, k, dtype)  # (any group of whole words)
    reference = dequantize(layer.weight, args[1], layer.zeros, format, group, k, dtype).to(dtype).float()
    assert ((weight.float() - reference).abs() <= reference.abs() * 2.0 ** -7).all()
    alone = qlinear_invariant(x[3:4], *args)
    for rows in (5, 17, MAX_ROWS[format], past):
        assert torch.equal(qlinear_invariant(x[:rows], *args)[3:4], alone), rows  # the same bits in any row count


def test_a_quantized_linears_fp32_bias_is_added_in_the_rows_dtype_on_every_path():
    """A QuantLinear keeps its bias in fp32: the reference, qlinear's tiles and its dequantized path past them
    each add it to bf16 rows in bf16 (the reference and the dequantized path added it as fp32, which F.linear
    refuses: found by the first GPU run of tinygemm's rows, run 147)."""
    g = torch.Generator().manual_seed(0)
    layer = random_quantized(24, 256, "int4", 64, g)
    args = (layer.weight, layer.scales.to(torch.bfloat16), layer.zeros, layer.bias, "int4", 64)
    assert layer.bias.dtype == torch.float32
    x = torch.randn(MAX_ROWS["int4"] + 1, 256, generator=g).to(torch.bfloat16)
    for rows in (1, MAX_ROWS["int4"] + 1):  # the tiles, then the dequantized weight through F.linear
        expected, got = qlinear_reference(x[:rows], *args), qlinear(x[:rows], *args)
        assert expected.dtype == got.dtype == torch.bfloat16
        assert ((got.float() - expected.float()).abs() / expected.float().abs().clamp(min=1)).max() < 2e-2, rows


def test_tinygemms_layout_of_an_int4_weight_projects_as_the_reference():
    """kernels/qlinear/tinygemm.py's conversion of QuantLinear's zero points and scales to tinygemm's
    (q - 8) * s + offset, through torch's CPU variant of its layout (on a GPU, use_tinygemm checks the CUDA one);
    a format or group tinygemm lacks gets none."""
    from specgraph.kernels.qlinear.tinygemm import project_tinygemm, tinygemm_layout

    g = torch.Generator().manual_seed(7)
    layer = random_quantized(48, 256, "int4", 32, g)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    packed, scales_and_zeros = tinygemm_layout(layer)
    got = project_tinygemm(x, packed, scales_and_zeros, 32, layer.bias.data.to(torch.bfloat16)).float()
    expected = qlinear_reference(x.float(), layer.weight, layer.scales, layer.zeros, layer.bias.data, "int4", 32)
    assert ((got - expected).abs() / expected.abs().clamp(min=1)).max() < 2e-2
    assert tinygemm_layout(random_quantized(48, 256, "int8", 64, g)) is None
    assert tinygemm_layout(random_quantized(48, 512, "int4", 512, g)) is None
    assert tinygemm_layout(random_quantized(40, 256, "int4", 32, g)) is None  # (N: tiles of 16)


@pytest.mark.parametrize("k", [1, 3])
def test_the_fused_gumbel_kernel_picks_what_the_reference_picks(k):
    """The sampling rule's perturbed top-k (kernels/gumbel, tests/test_seeded.py uses it): Two blocks of the vocabulary, a row at temperature 0, filtered rows, huge seeds and positions."""
    generator = torch.Generator().manual_seed(k)
    t, v = 7, 5000
    logits = torch.randn(t, v, generator=generator) * 3
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.0, 2.0, 1.0, 0.3])
    cut = torch.tensor([float("-inf"), float("-inf"), float("-inf"), 2.0, float("-inf"), 0.0, 1.0])
    cut[5] = logits[5].topk(2).values[-1]  # two tokens kept
    seeds = torch.tensor([0, 1, 2, 3, -5, 2 ** 62, 7])
    positions = torch.tensor([0, 10, 20, 30, 40, 2 ** 40, 4999])
    tokens, scores = perturbed_top(logits, temperature, cut, seeds, positions, k)
    ref_tokens, ref_scores = perturbed_top_reference(logits, temperature, cut, seeds, positions, k)
    assert torch.isinf(ref_scores[5]).sum() == k - min(k, 2)  # (past a filter's tokens, picks score -inf)
    finite = torch.isfinite(ref_scores)
    assert torch.equal(tokens[finite], ref_tokens[finite])
    assert torch.allclose(scores, ref_scores, atol=1e-5, rtol=0) and torch.equal(torch.isfinite(scores), finite)
    assert torch.equal(tokens[2], logits[2].topk(k).indices)  # temperature 0: the logits' own top k
    torch.library.opcheck(perturbed_top, (logits, temperature, cut, seeds, positions, k),
                          test_utils=("test_faketensor",))
