"""Verification rules. The residual rule is tested statistically: output frequencies of the engine
over Markov-chain models with known distributions approach the target's, one request at a time and
many at once (the sampling rule's tests: tests/test_seeded.py)."""

import pytest
import torch
from helpers import HostReads, markov_engine

from specgraph.draws import Draws
from specgraph.recipe import ChainTree, DynamicTree, SamplingSpec, StaticTree, VerifySpec
from specgraph.sampling import SamplingRows, probs_from_logits
from specgraph.tree import Tree, TreeTopology
from specgraph.verify import verify

V = 6
GREEDY, SAMPLING, RESIDUAL, TYPICAL = (VerifySpec(rule=rule) for rule in ("greedy", "sampling", "residual", "typical"))


def one(tokens, parents, proposals=None) -> Tree:
    return Tree(torch.tensor([tokens]), torch.tensor([parents]), proposals)


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
    both = Tree(torch.cat([a.tokens, b.tokens]), torch.cat([a.parents, b.parents]), None,
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
    tree = one([0, 1, 2, 3, 4], [-1, 0, 0, 1, 3], torch.full((1, 5, V), 1.0 / V))
    logits, grid = torch.randn(5, V), grid_of(tree)
    sampling = SamplingRows.of([SamplingSpec(temperature=1.0, top_k=3)], "cpu")
    streams = [Draws.of([0], "cpu") for _ in range(4)]
    segments, positions = torch.zeros(5, dtype=torch.long), torch.arange(5) + 7
    with HostReads() as reads:
        verdicts = [verify(tree, logits, grid, spec, sampling, draws, segments=segments, positions=positions)
                    for spec, draws in zip((GREEDY, SAMPLING, RESIDUAL, TYPICAL), streams)]
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


def filtered(table: torch.Tensor, sampling: SamplingSpec) -> torch.Tensor:
    return probs_from_logits(table.log()[None], SamplingRows.of([sampling], "cpu"))[0]


def two_token_frequencies(plan, sampling, samples: int, batch: int = 1) -> tuple[torch.Tensor, ...]:
    """Empirical joint of the first two generated tokens after prompt [0], over `samples` seeds
    decoded `batch` at a time, and the exact target and draft joints."""
    p, q = markov_tables(11)
    engine = markov_engine(p, None if plan is None else q, plan, "residual", sampling, batch=batch)
    requests = [engine.add_request([0], 2, sampling.model_copy(update={"seed": seed})) for seed in range(samples)]
    while engine.busy:
        engine.step()
    counts = torch.zeros(V, V)
    for request in requests:
        first, second = request.generation.output_ids
        counts[first, second] += 1
    fp, fq = filtered(p, sampling), filtered(q, sampling)
    return counts / samples, fp[0][:, None] * fp, fq[0][:, None] * fq


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("plan, sampling, batch", [
    (TreeTopology.from_spec(ChainTree(length=3)), SamplingSpec(temperature=1.0), 1),
    (TreeTopology.from_spec(StaticTree(branching=[3, 2])), SamplingSpec(temperature=1.0), 1),
    (TreeTopology.from_spec(StaticTree(branching=[2, 2])), SamplingSpec(temperature=0.8, top_k=4, top_p=0.9), 1),
    (DynamicTree(width=2, depth=2, nodes=5), SamplingSpec(temperature=1.0), 1),
    (TreeTopology.from_spec(StaticTree(branching=[3, 2])), SamplingSpec(temperature=1.0), 16),
    (DynamicTree(width=2, depth=2, nodes=5), SamplingSpec(temperature=0.9, top_k=5), 16),
], ids=["chain", "static", "static-topk-topp", "dynamic", "static-batched", "dynamic-batched"])
def test_speculative_sampling_reproduces_the_target_distribution(plan, sampling, batch):
    few, exact, draft = two_token_frequencies(plan, sampling, 300, batch)
    many, _, _ = two_token_frequencies(plan, sampling, 3000, batch)
    wrong = tv(draft, exact)
    assert wrong > 0.3  # the draft's own distribution is far from the target's
    assert tv(many, exact) < tv(few, exact)  # the distance shrinks with samples
    assert tv(many, exact) < 0.06 < wrong / 5  # and ends far below that of the wrong distribution


def test_autoregressive_sampling_draws_from_the_target_distribution():
    """No drafter: each step samples the bonus from the target's filtered distribution."""
    sampling = SamplingSpec(temperature=0.9, top_k=4)
    few, exact, _ = two_token_frequencies(None, sampling, 300)
    many, _, _ = two_token_frequencies(None, sampling, 3000, batch=8)
    assert tv(many, exact) < tv(few, exact) and tv(many, exact) < 0.05
    assert (many[exact == 0] == 0).all()  # nothing outside top-k


def test_a_request_samples_the_same_tokens_alone_and_in_a_batch():
    """Each request draws from its own stream (draws.py): the batch around it changes nothing."""
    p, q = markov_tables(3)
    sampling = SamplingSpec(temperature=1.0)
    plan = TreeTopology.from_spec(StaticTree(branching=[2, 2]))
    alone = markov_engine(p, q, plan, "residual", sampling).generate([1, 2], 24, seed=7).output_ids
    engine = markov_engine(p, q, plan, "residual", sampling, batch=4)
    requests = [engine.add_request([1, 2] if seed == 7 else [seed % V], 24, sampling.model_copy(update={"seed": seed}))
                for seed in (3, 7, 11, 5)]
    while engine.busy:
        engine.step()
    assert requests[1].generation.output_ids == alone
