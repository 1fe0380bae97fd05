"""Verification rules: greedy and typical verdicts, each request's stream its own (the sampling
rule's tests, over seeds against known distributions too: tests/test_seeded.py)."""

import torch
from helpers import HostReads, markov_engine

from specgraph.draws import Draws
from specgraph.recipe import SamplingSpec, StaticTree, VerifySpec
from specgraph.sampling import SamplingRows, probs_from_logits
from specgraph.tree import Tree, TreeTopology
from specgraph.verify import verify

V = 6
GREEDY, SAMPLING, TYPICAL = (VerifySpec(rule=rule) for rule in ("greedy", "sampling", "typical"))


def one(tokens, parents) -> Tree:
    return Tree(torch.tensor([tokens]), torch.tensor([parents]))


def grid_of(*trees: Tree) -> torch.Tensor:
    """Each tree's nodes at consecutive rows of one packed forward."""
    sizes = [t.size for t in trees]
    return torch.tensor([[sum(sizes[:r]) + i for i in range(max(sizes))] for r in range(len(trees))])


def test_greedy_walks_the_matching_children():
    tree = one([5, 1, 2, 3, 4, 0], [-1, 0, 0, 2, 2, 4])
    logits = torch.full((6, V), -1.0)
    for node, best in {0: 2, 2: 4, 4: 0, 5: 3}.items():
        logits[node, best] = 1.0
    verdict = verify(tree, logits, grid_of(tree), GREEDY, None, None)
    assert verdict.paths.tolist() == [[0, 2, 4, 5]] and verdict.bonus.tolist() == [3]
    counts, new = verdict.accepted(tree)
    assert counts.tolist() == [4] and new.tolist() == [[2, 4, 0, 3]]
    logits[0] = 0
    logits[0, 3] = 1  # no child of the root matches: bonus only
    verdict = verify(tree, logits, grid_of(tree), GREEDY, None, None)
    counts, new = verdict.accepted(tree)
    assert verdict.paths.tolist() == [[0, -1, -1, -1]] and counts.tolist() == [1] and new[0, 0] == 3


def test_greedy_verdicts_of_a_batch_are_each_trees_own():
    """Two trees verified from one packed forward: each gets the verdict it gets alone."""
    a, b = one([5, 1, 2, 3], [-1, 0, 0, 2]), one([4, 3, 0, 1], [-1, 0, 1, 2])
    logits = torch.randn(8, V)
    both = Tree(torch.cat([a.tokens, b.tokens]), torch.cat([a.parents, b.parents]),
                type(a.structure)(3, torch.cat([a.depths, b.depths]), torch.cat([a.child_table[:, :, :2],
                                  torch.nn.functional.pad(b.child_table, (0, 1), value=-1)]),
                                  torch.cat([a.ancestors, b.ancestors])))
    batch = verify(both, logits, grid_of(a, b), GREEDY, None, None)
    alone = [verify(t, logits[4 * r : 4 * r + 4], grid_of(t), GREEDY, None, None) for r, t in enumerate((a, b))]
    assert batch.paths[:, : 3].tolist() == [v.paths[0, :3].tolist() for v in alone]
    assert batch.bonus.tolist() == [int(v.bonus) for v in alone]


def test_typical_accepts_probable_children_and_rejects_improbable():
    tree = one([0, 1, 2], [-1, 0, 0])
    logits = torch.tensor([[0.0, -9.0, 3.0, 0.0, 0.0, 0.0]] * 3)
    verdict = verify(tree, logits, grid_of(tree), TYPICAL, SamplingRows.of([SamplingSpec(temperature=1.0)], "cpu"),
                     Draws.of([0], "cpu"))
    assert verdict.paths.tolist() == [[0, 2]]  # token 2 is likely, token 1 is not


def test_verification_makes_no_host_reads():
    tree = one([0, 1, 2, 3, 4], [-1, 0, 0, 1, 3])
    logits, grid = torch.randn(5, V), grid_of(tree)
    sampling = SamplingRows.of([SamplingSpec(temperature=1.0, top_k=3)], "cpu")
    streams = [Draws.of([0], "cpu") for _ in range(3)]
    segments, positions = torch.zeros(5, dtype=torch.long), torch.arange(5) + 7
    with HostReads() as reads:
        verdicts = [verify(tree, logits, grid, spec, sampling, draws, segments=segments, positions=positions)
                    for spec, draws in zip((GREEDY, SAMPLING, TYPICAL), streams)]
        counts = [v.accepted(tree) for v in verdicts]
    assert reads.seen == [] and all(new.shape == (1, 4) for _, new in counts)
    assert all(v.paths.shape == (1, 4) and v.bonus.shape == (1,) for v in verdicts)
    with HostReads() as reads:
        torch.tensor([1, 2]).nonzero()
    assert reads.seen  # the recorder does see syncing ops


def test_each_row_is_filtered_by_its_own_settings():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    rows = SamplingRows.of([SamplingSpec(), SamplingSpec(temperature=1.0, top_k=2),
                            SamplingSpec(temperature=1.0, top_p=0.8)], "cpu")
    probs = probs_from_logits(logits[:, None], rows)[:, 0]
    assert torch.allclose(probs, torch.tensor([[1.0, 0, 0, 0], [0.625, 0.375, 0, 0], [0.625, 0.375, 0, 0]]))


def markov_tables(seed: int):
    torch.manual_seed(seed)
    p = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((V,))  # target [V, V]
    q = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((V,))  # draft
    return p, q


def test_a_request_samples_the_same_tokens_alone_and_in_a_batch():
    """Under the typical rule each request draws its bonus tokens from its own stream (draws.py):
    the batch around it changes nothing."""
    p, q = markov_tables(3)
    sampling = SamplingSpec(temperature=1.0)
    plan = TreeTopology.from_spec(StaticTree(branching=[2, 2]))
    alone = markov_engine(p, q, plan, "typical", sampling).generate([1, 2], 24, seed=7).output_ids
    engine = markov_engine(p, q, plan, "typical", sampling, batch=4)
    requests = [engine.add_request([1, 2] if seed == 7 else [seed % V], 24, sampling.model_copy(update={"seed": seed}))
                for seed in (3, 7, 11, 5)]
    while engine.busy:
        engine.step()
    assert requests[1].generation.output_ids == alone
