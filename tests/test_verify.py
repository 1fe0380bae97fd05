"""Verification rules. Sampling is tested statistically: output frequencies of the speculative
executor over Markov-chain models with known distributions approach the target's."""

import pytest
import torch
from helpers import HostReads, MarkovModel

from specgraph.draft import Drafter
from specgraph.recipe import ChainTree, DynamicTree, SamplingSpec, StaticTree, VerifySpec
from specgraph.runtime.serial import SerialExecutor
from specgraph.runtime.verifier import Verifier
from specgraph.runtime.stage import Stage
from specgraph.sampling import probs_from_logits
from specgraph.tree import Tree, TreeTopology
from specgraph.verify import verify_greedy, verify_sampling, verify_typical

V = 6


def test_greedy_walks_the_matching_children():
    tree = Tree(tokens=torch.tensor([5, 1, 2, 3, 4, 0]), parents=torch.tensor([-1, 0, 0, 2, 2, 4]))
    logits = torch.full((6, V), -1.0)
    for node, best in {0: 2, 2: 4, 4: 0, 5: 3}.items():
        logits[node, best] = 1.0
    verdict = verify_greedy(tree, logits)
    assert verdict.path.tolist() == [0, 2, 4, 5] and verdict.bonus == 3
    count, new = verdict.accepted(tree)
    assert count == 4 and new.tolist() == [2, 4, 0, 3]
    logits[0] = 0
    logits[0, 3] = 1  # no child of the root matches: bonus only
    verdict = verify_greedy(tree, logits)
    count, new = verdict.accepted(tree)
    assert verdict.path.tolist() == [0, -1, -1, -1] and count == 1 and new[0] == 3


def test_typical_accepts_probable_children_and_rejects_improbable():
    tree = Tree(tokens=torch.tensor([0, 1, 2]), parents=torch.tensor([-1, 0, 0]))
    logits = torch.tensor([[0.0, -9.0, 3.0, 0.0, 0.0, 0.0]] * 3)
    verdict = verify_typical(tree, logits, SamplingSpec(temperature=1.0), VerifySpec(rule="typical"),
                             torch.Generator().manual_seed(0))
    assert verdict.path.tolist() == [0, 2]  # token 2 is likely, token 1 is not


def test_verification_makes_no_host_reads():
    tree = Tree(tokens=torch.tensor([0, 1, 2, 3, 4]), parents=torch.tensor([-1, 0, 0, 1, 3]),
                proposals=torch.full((5, V), 1.0 / V))
    logits = torch.randn(5, V)
    sampling, g = SamplingSpec(temperature=1.0), torch.Generator().manual_seed(0)
    with HostReads() as reads:
        verdicts = [verify_greedy(tree, logits), verify_sampling(tree, logits, sampling, g),
                    verify_typical(tree, logits, sampling, VerifySpec(rule="typical"), g)]
        counts = [v.accepted(tree) for v in verdicts]
    assert reads.seen == [] and all(new.shape == (4,) for _, new in counts)
    assert all(v.path.shape == (4,) and v.bonus.shape == () for v in verdicts)
    with HostReads() as reads:
        torch.tensor([1, 2]).nonzero()
    assert reads.seen  # the recorder does see syncing ops


def markov_tables(seed: int):
    torch.manual_seed(seed)
    p = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((V,))  # target [V, V]
    q = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((V,))  # draft
    return p, q


def filtered(table: torch.Tensor, sampling: SamplingSpec) -> torch.Tensor:
    return probs_from_logits(table.log(), sampling)


def two_token_frequencies(plan, sampling, samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empirical joint of the first two generated tokens after prompt [0], and the exact target and draft joints."""
    p, q = markov_tables(11)
    cpu = torch.device("cpu")
    verifier = Verifier(Stage("t", MarkovModel(p), 64, cpu), VerifySpec(), "sampling", sampling)
    drafter = Drafter(Stage("d", MarkovModel(q), 64, cpu), plan, "sampling", sampling)
    executor = SerialExecutor(verifier, drafter, eos_ids=(), max_seq_len=64)
    counts = torch.zeros(V, V)
    for seed in range(samples):
        first, second = executor.generate([0], 2, seed=seed).output_ids
        counts[first, second] += 1
    fp, fq = filtered(p, sampling), filtered(q, sampling)
    return counts / samples, fp[0][:, None] * fp, fq[0][:, None] * fq


def tv(a, b):
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("plan, sampling", [
    (TreeTopology.from_spec(ChainTree(length=3)), SamplingSpec(temperature=1.0)),
    (TreeTopology.from_spec(StaticTree(branching=[3, 2])), SamplingSpec(temperature=1.0)),
    (TreeTopology.from_spec(StaticTree(branching=[2, 2])), SamplingSpec(temperature=0.8, top_k=4, top_p=0.9)),
    (DynamicTree(width=2, depth=2, nodes=5), SamplingSpec(temperature=1.0)),
], ids=["chain", "static", "static-topk-topp", "dynamic"])
def test_speculative_sampling_reproduces_the_target_distribution(plan, sampling):
    few, exact, draft = two_token_frequencies(plan, sampling, 300)
    many, _, _ = two_token_frequencies(plan, sampling, 3000)
    wrong = tv(draft, exact)
    assert wrong > 0.3  # the draft's own distribution is far from the target's
    assert tv(many, exact) < tv(few, exact)  # the distance shrinks with samples
    assert tv(many, exact) < 0.06 < wrong / 5  # and ends far below that of the wrong distribution


def test_autoregressive_sampling_draws_from_the_target_distribution():
    """No drafter: each step samples the bonus from the target's filtered distribution."""
    p, _ = markov_tables(11)
    sampling = SamplingSpec(temperature=0.9, top_k=4)
    cpu = torch.device("cpu")
    executor = SerialExecutor(Verifier(Stage("t", MarkovModel(p), 64, cpu), VerifySpec(), "sampling", sampling), None,
                              eos_ids=(), max_seq_len=64)

    def frequencies(samples: int) -> torch.Tensor:
        counts = torch.zeros(V, V)
        for seed in range(samples):
            first, second = executor.generate([0], 2, seed=seed).output_ids
            counts[first, second] += 1
        return counts / samples

    fp = filtered(p, sampling)
    exact = fp[0][:, None] * fp
    few, many = frequencies(300), frequencies(3000)
    assert tv(many, exact) < tv(few, exact) and tv(many, exact) < 0.05
    assert (many[exact == 0] == 0).all()  # nothing outside top-k
