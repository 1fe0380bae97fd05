"""Tree topologies, ancestor masks and the trees the drafter grows."""

import pytest
import torch
from conftest import EMBEDDED
from helpers import HostReads, chain_logits, grown_on_the_host

from specgraph.draft import Drafter, Requests
from specgraph.models.loader import load_model
from specgraph.recipe import ChainTree, DynamicTree, SamplingSpec, StaticTree
from specgraph.runtime.stage import Stage
from specgraph.sampling import SamplingRows
from specgraph.tree import Tree, TreeStructure, TreeTopology


def test_chain_branching_and_paths_topologies():
    assert TreeTopology.from_spec(ChainTree(length=3)).parents == (-1, 0, 1, 2)
    topo = TreeTopology.from_spec(StaticTree(branching=[2, 1]))
    assert topo.parents == (-1, 0, 0, 1, 2) and topo.ranks == (0, 0, 1, 0, 0)
    assert topo.depths == (0, 1, 1, 2, 2) and topo.nodes == 4 and topo.max_depth == 2
    medusa = TreeTopology.from_spec(StaticTree(paths=[[0], [1], [0, 0], [0, 1], [2], [0, 0, 0]]))
    assert medusa.parents == (-1, 0, 0, 0, 1, 1, 4) and medusa.children(1) == [4, 5]


def test_ancestor_mask_and_depths():
    tree = Tree(tokens=torch.arange(6)[None], parents=torch.tensor([[-1, 0, 0, 1, 3, 2]]))
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                             [1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestors[0], expected)
    assert tree.depths.tolist() == [[0, 1, 1, 2, 3, 2]]


def test_structures_built_on_the_device_match_the_host_ones():
    parents = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 0, 4]]
    device = TreeStructure.of_parents(torch.tensor(parents), 5, 3)
    for row, tree in enumerate(parents):
        host = TreeStructure.of(tree, "cpu")
        assert torch.equal(device.depths[row], host.depths[0]) and torch.equal(device.ancestors[row], host.ancestors[0])
        assert [[c for c in kids if c >= 0] for kids in device.child_table[row].tolist()] == [
            [c for c in kids if c >= 0] for kids in host.child_table[0].tolist()]


def drafter(plan, rule="greedy"):
    model = load_model(EMBEDDED / "draft", torch.float32, "cpu")
    return Drafter(Stage("draft", model, 128, torch.device("cpu")), plan, rule)


def draft(d: Drafter, committed: torch.Tensor, prefill: bool = True) -> Tree:
    """A tree from `committed` [L] (prefilled into the draft cache first unless `prefill` is False)."""
    buffer = torch.zeros(64, dtype=torch.long)
    buffer[: committed.numel()] = committed
    if prefill:
        d.prefill(committed)
    length = committed.numel()
    request = Requests.one(buffer, torch.tensor(length), min(2, length))
    return d.draft(request, d.stage.width(length, 40)).tree


def check_well_formed(tree: Tree, size: int):
    assert tree.size == size and tree.rows == 1
    assert all(0 <= int(p) < i for i, p in enumerate(tree.parents[0].tolist()) if i > 0)  # topological
    for node in range(tree.size):  # siblings carry distinct tokens
        kids = tree.children(node)
        assert len(set(tree.tokens[0, kids].tolist())) == len(kids)


def test_static_drafts_follow_the_draft_models_ranking():
    d = drafter(TreeTopology.from_spec(StaticTree(branching=[3, 2])))
    committed = torch.randint(0, 4096, (12,))
    tree = draft(d, committed)
    check_well_formed(tree, 1 + 3 + 6)
    model = d.stage.model
    logits = chain_logits(model, committed)[-1]
    assert tree.tokens[0, 1:4].tolist() == logits.topk(3).indices.tolist()
    # the children of node 1 are the top-2 after appending node 1's token
    logits = chain_logits(model, torch.cat([committed, tree.tokens[0, 1:2]]))[-1]
    assert tree.tokens[0, tree.children(1)].tolist() == logits.topk(2).indices.tolist()


def test_dynamic_tree_keeps_the_most_likely_nodes():
    spec = DynamicTree(width=3, depth=4, nodes=10)
    d = drafter(spec)
    committed = torch.randint(0, 4096, (9,), generator=torch.Generator().manual_seed(5))
    tree = draft(d, committed)
    check_well_formed(tree, 11)
    assert int(tree.depths.max()) >= 2  # expansion went deeper than the root's children
    assert (tree.tokens[0].tolist(), tree.parents[0].tolist()) == grown_on_the_host(
        lambda ids: chain_logits(d.stage.model, ids)[-1], committed, spec)


@pytest.mark.parametrize("plan, size", [(TreeTopology.from_spec(StaticTree(branching=[3, 2, 1])), 1 + 3 + 6 + 6),
                                        (DynamicTree(width=3, depth=3, nodes=10), 11)], ids=["static", "dynamic"])
def test_drafting_reads_nothing_on_the_host(plan, size):
    for rule, sampling in (("greedy", SamplingSpec()), ("sampling", SamplingSpec(temperature=0.9, top_k=40))):
        d = drafter(plan, rule)
        committed = torch.randint(0, 4096, (10,))
        d.prefill(committed)
        buffer = torch.cat([committed, torch.tensor([7, 8]), torch.zeros(20, dtype=torch.long)])
        rows = SamplingRows.of([sampling], "cpu")
        first = d.draft(Requests.one(buffer, torch.tensor(10)), d.stage.width(10, 40), rows)
        path = torch.tensor([[0, 1, -1, -1]])  # one draft accepted
        old, new = Requests.one(buffer, torch.tensor(10)), Requests.one(buffer, torch.tensor(12))
        with HostReads() as reads:
            d.commit(first, path, old)
            tree = d.draft(new, d.stage.width(12, 40), rows).tree
        assert reads.seen == [] and tree.size == size
