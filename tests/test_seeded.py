"""The sampling rule (verify.py, sampling.py): every token is the argmax of the target's filtered
log-probabilities plus Gumbel noise keyed by (seed, position, token), so any recipe samples
exactly the tokens of the target alone with the same seed, and over seeds they follow the target's
distribution.

The oracle is transformers' model of the target fixture in fp32, its logits filtered here (top-k,
top-p, stop tokens before min_tokens) and perturbed by draws.gumbel: nothing of the engine, the
drafters or verification. The statistical tests run the engine over Markov-chain models of known
distributions, each bound a quantile of simulated runs (helpers.simulated_distances), with a
power check: an acceptance rule biased by 0.02 fails the same bound."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from conftest import EMBEDDED, REPO, shared_model
from helpers import Alone, decode_requests, filtered_log_probs, markov_engine, simulated_distances, total_variation, two_stage

from specgraph.draws import gumbel
from specgraph.program import Program
from specgraph.recipe import ChainTree, DynamicTree, Recipe, SamplingSpec, StaticTree
from specgraph.tree import TreeTopology

TARGET, DRAFT, HEAD = EMBEDDED / "target", EMBEDDED / "draft", EMBEDDED / "eagle3"
SAMPLING = {"temperature": 0.8, "top_k": 50, "top_p": 0.95}
PROMPTS = ["def parse(path):\n    with open(path) as f:\n", "import os\nimport sys\n\n\ndef main(argv):\n"]
NEW = 24
TREES = {"chain": {"shape": "chain", "length": 3},
         "static": {"shape": "static", "branching": [3, 2, 1]},
         "dynamic": {"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}}


@pytest.fixture(scope="module")
def alone() -> Alone:
    return Alone(TARGET)


def expected(alone: Alone, seed: int, sampling: dict = SAMPLING, new: int = NEW) -> list[list[int]]:
    return [alone.sample(alone.encode(text), new, seed, **sampling) for text in PROMPTS]


def decoded(program: Program, seed: int, new: int = NEW) -> list[list[int]]:
    return [program.generate(program.encode(text), new, seed).output_ids for text in PROMPTS]


def recipe(draft, tree: dict | None, sampling: dict = SAMPLING, **fields) -> Recipe:
    return two_stage(TARGET, draft, tree, sampling=sampling, max_new_tokens=NEW, **fields)


# -- the noise and its kernel

def test_the_keyed_noise_is_a_standard_gumbel_of_its_key_alone():
    g = gumbel(torch.arange(4000), torch.tensor(17), 64)  # [seeds, V]
    assert torch.equal(g[5], gumbel(torch.tensor(5), torch.tensor(17), 64))  # nothing but (seed, position, token)
    assert not torch.equal(g[5], gumbel(torch.tensor(5), torch.tensor(18), 64))
    assert abs(float(g.mean()) - 0.5772) < 0.01 and abs(float(g.var()) - torch.pi ** 2 / 6) < 0.02
    upper = torch.distributions.Gumbel(0.0, 1.0).cdf(torch.tensor(8.0))  # the upper tail, which decides argmaxes
    assert abs(float((g > 8).float().mean()) - float(1 - upper)) < 2e-4
    assert float(g.max()) > 10  # past what 24 bits of a uniform can reach (16.6 at most: the tail is resolved)


# -- every recipe samples the target alone's tokens

@pytest.mark.parametrize("shape", list(TREES))
def test_a_draft_model_samples_the_target_alone_tokens(alone, shape):
    program = Program.from_recipe(recipe(DRAFT, TREES[shape]))
    assert decoded(program, 7) == expected(alone, 7)


def test_plain_decoding_samples_the_target_alone_tokens_and_another_seed_others(alone):
    program = Program.from_recipe(recipe(None, None))
    assert decoded(program, 7) == expected(alone, 7)
    assert decoded(program, 8) == expected(alone, 8) != expected(alone, 7)


@pytest.mark.parametrize("shape", ["chain", "static"])
def test_an_eagle3_head_samples_the_target_alone_tokens(alone, shape):
    program = Program.from_recipe(recipe(HEAD, TREES[shape]))
    assert decoded(program, 3) == expected(alone, 3)


def test_adaptive_speculation_samples_the_target_alone_tokens(alone):
    """The policy picks each step's mode from timings (plain or a tree of some depth): same tokens."""
    program = Program.from_recipe(recipe(DRAFT, TREES["dynamic"], serving={"speculation": "adaptive"}))
    assert decoded(program, 11) == expected(alone, 11)


MIXED = [({"temperature": 0.8, "top_p": 0.9}, 1), ({"temperature": 1.0}, 2), ({"temperature": 0.6, "top_k": 5}, 3),
         ({"temperature": 1.2, "top_k": 100, "top_p": 0.8}, 4), ({"temperature": 0.8, "top_p": 0.9}, 5)]


@pytest.mark.parametrize("speculation", ["always", "adaptive"])
def test_a_batch_of_mixed_settings_under_a_budget_samples_each_request_alone_tokens(alone, speculation):
    """Five requests of their own seeds, temperatures, top-k and top-p in one engine with a
    verification budget over the batch: each gets the target alone's tokens for its settings."""
    budget = {"nodes": {1: 10, 2: 12, 4: 16, 8: 24}}
    program = Program.from_recipe(two_stage(TARGET, DRAFT, TREES["dynamic"], verify={"budget": budget},
                                            sampling={"temperature": 0.8}, max_new_tokens=NEW,
                                            serving={"max_batch": 5, "speculation": speculation}))
    prompts = [alone.encode(PROMPTS[i % 2]) for i in range(len(MIXED))]
    handles = decode_requests(program.executor, [
        {"prompt": ids, "new": NEW, "sampling": SamplingSpec(**settings, seed=seed)}
        for ids, (settings, seed) in zip(prompts, MIXED)])
    assert [h.generation.output_ids for h in handles] == [
        alone.sample(ids, NEW, seed, **settings) for ids, (settings, seed) in zip(prompts, MIXED)]


def test_disaggregated_execution_samples_the_target_alone_tokens(alone):
    for shape in ("static", "dynamic"):
        with Program.from_recipe(recipe(DRAFT, TREES[shape], execution="disaggregated")) as program:
            assert decoded(program, 5) == expected(alone, 5), shape


def test_pipeline_execution_samples_the_target_alone_tokens(alone):
    models = {"m0": DRAFT, "m1": shared_model("mid"), "m2": TARGET}
    stages = [{"name": "s0", "model": "m0", "devices": ["cpu"], "tree": TREES["chain"]},
              {"name": "s1", "model": "m1", "devices": ["cpu"], "verifies": "s0"},
              {"name": "s2", "model": "m2", "devices": ["cpu"], "verifies": "s1"}]
    pipeline = Recipe.from_dict({"name": "test", "execution": "pipeline", "sampling": SAMPLING, "max_new_tokens": NEW,
                                 "models": {k: {"path": str(v), "dtype": "float32"} for k, v in models.items()},
                                 "stages": stages})
    with Program.from_recipe(pipeline) as program:
        assert decoded(program, 9) == expected(alone, 9)


def test_the_server_streams_each_seed_the_target_alone_tokens_whatever_shares_its_batch(alone, tmp_path):
    """`specgraph serve` of a sampling recipe under the adaptive policy, four requests at once: two
    identical ones of the same seed stream the same text, and each of mixed seeds, temperatures and
    top-p streams the text of the target alone's tokens for its settings."""
    from test_server import serving

    asks = [({"temperature": 0.8}, 7), ({"temperature": 0.8}, 7), ({"temperature": 1.0, "top_p": 0.9}, 3),
            ({"temperature": 0.6, "top_p": 0.8}, 5)]
    args = [str(REPO / "recipes" / "demo.yaml"), "--batch", "4", "--set", "sampling.temperature=0.8",
            "--set", "stages.1.verify.rule=sampling", "--set", f"max_new_tokens={NEW}"]
    for server in serving(args, tmp_path / "server.log"):
        client = server.client()

        def streamed(ask) -> str:
            settings, seed = ask
            stream = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=NEW, seed=seed, stream=True,
                                               **settings)
            return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

        with ThreadPoolExecutor(len(asks)) as pool:
            texts = list(pool.map(streamed, asks))
    ids = alone.encode(PROMPTS[0])
    wanted = [alone.tokenizer.decode(alone.sample(ids, NEW, seed, **settings), skip_special_tokens=True)
              for settings, seed in asks]
    assert texts[0] == texts[1] and texts == wanted


# -- top-k, top-p, min_tokens and stop tokens

def test_a_top_k_of_one_or_a_tiny_top_p_samples_the_greedy_tokens(alone):
    """Whatever the noise, a filter that keeps one token leaves the argmax (transformers' greedy)."""
    ids = alone.encode(PROMPTS[0])
    greedy = alone.model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)[0, len(ids):].tolist()
    for sampling in ({"temperature": 1.5, "top_k": 1}, {"temperature": 1.5, "top_p": 1e-6}):
        program = Program.from_recipe(recipe(DRAFT, TREES["static"], sampling=sampling))
        assert program.generate(ids, NEW, 13).output_ids == greedy, sampling


def test_stop_tokens_end_a_request_only_after_its_min_tokens(alone):
    """A stop token that the target alone samples early (at new token 2 unrestricted) is kept from
    being drawn until min_tokens; the request then ends at the first one drawn, as the oracle's."""
    ids, seed = alone.encode(PROMPTS[1]), 21
    free = alone.sample(ids, NEW, seed, **SAMPLING)
    stops, min_tokens = (free[2],), 6
    wanted = alone.sample(ids, NEW, seed, **SAMPLING, stops=stops, min_tokens=min_tokens)
    assert stops[0] not in wanted[:min_tokens] and wanted != free[: len(wanted)]
    program = Program.from_recipe(recipe(DRAFT, TREES["static"]))
    (handle,) = decode_requests(program.executor, [{"prompt": ids, "new": NEW, "stops": stops, "min_tokens": min_tokens,
                                                    "sampling": program.executor.sampling.model_copy(update={"seed": seed})}])
    assert handle.generation.output_ids == wanted


# -- over seeds: the target's distribution (Markov-chain models)

V = 6


def markov_tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    p = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((V,))  # target [V, V]
    q = torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((V,))  # draft
    return p, q


def exact_law(table: torch.Tensor, sampling: SamplingSpec, tokens: int) -> dict[tuple[int, ...], float]:
    """The law of the first `tokens` tokens after prompt [0] of a Markov target, filtered as `sampling` says."""
    probs = filtered_log_probs_table(table, sampling).exp()  # [V, V]
    law = {(): 1.0}
    for _ in range(tokens):
        law = {(*path, b): mass * float(probs[path[-1] if path else 0, b]) for path, mass in law.items() for b in range(V)}
    return {path: mass for path, mass in law.items() if mass > 0}


def filtered_log_probs_table(table: torch.Tensor, sampling: SamplingSpec) -> torch.Tensor:
    return torch.stack([filtered_log_probs(row.log() / sampling.temperature, sampling.top_k, sampling.top_p)
                        for row in table])


def sampled_law(engine, sampling: SamplingSpec, seeds: int, tokens: int) -> dict[tuple[int, ...], float]:
    handles = decode_requests(engine, [{"prompt": [0], "new": tokens, "sampling": sampling.model_copy(update={"seed": s})}
                                       for s in range(seeds)])
    paths = [tuple(h.generation.output_ids) for h in handles]
    return {path: paths.count(path) / seeds for path in set(paths)}


@pytest.mark.parametrize("plan, sampling", [
    (TreeTopology.from_spec(ChainTree(length=3)), SamplingSpec(temperature=1.0)),
    (TreeTopology.from_spec(StaticTree(branching=[3, 2])), SamplingSpec(temperature=0.8, top_k=4, top_p=0.9)),
    (DynamicTree(width=2, depth=2, nodes=5), SamplingSpec(temperature=0.9, top_k=5)),
    (None, SamplingSpec(temperature=1.0, top_p=0.8)),
], ids=["chain", "static-topk-topp", "dynamic-topk", "alone-topp"])
def test_over_seeds_the_first_two_tokens_follow_the_target_distribution(plan, sampling):
    p, q = markov_tables(11)
    exact, seeds = exact_law(p, sampling, 2), 3000
    observed = sampled_law(markov_engine(p, None if plan is None else q, plan, "sampling", sampling, batch=32),
                           sampling, seeds, 2)
    bound = float(simulated_distances(exact, seeds).quantile(0.9999))  # exceeded once in 10,000 runs of the exact law
    assert set(observed) <= set(exact)  # nothing outside the filters
    assert total_variation(observed, exact) < bound
    draft_law = exact_law(q, sampling, 2)  # power: the draft's own law always fails the bound
    assert simulated_distances(draft_law, seeds, to=exact, runs=2000).min() > bound


def test_an_acceptance_rule_biased_by_two_percent_fails_the_bound():
    """The first token over 20,000 seeds, a chain of one: the rule passes the bound (the 0.9999
    quantile of simulated runs of the exact law) and the same rule accepting a rejected draft one
    time in 50 fails it (the draft proposes a token the target rarely samples)."""
    p, _ = markov_tables(11)
    rare = int(p[0].argmin())
    q = torch.full((V, V), 1e-3).index_fill_(1, torch.tensor([rare]), 1.0)
    q = q / q.sum(1, keepdim=True)  # the draft: nearly always `rare`
    sampling, seeds = SamplingSpec(temperature=1.0), 20_000
    plan = TreeTopology.from_spec(ChainTree(length=1))
    exact = exact_law(p, sampling, 1)
    bound = float(simulated_distances(exact, seeds).quantile(0.9999))
    fair = markov_engine(p, q, plan, "sampling", sampling, batch=64)
    assert total_variation(sampled_law(fair, sampling, seeds, 1), exact) < bound
    biased = markov_engine(p, q, plan, "sampling", sampling, batch=64)
    verifier = biased.runner.verifier
    generator = torch.Generator().manual_seed(0)
    accept = verifier.kernels.accept_greedy

    def accept_biased(tokens, parents, ancestors, depths, best, max_depth):
        lucky = torch.rand(best.shape[0], generator=generator) < 0.02  # [R]: the root's child accepted anyway
        best = best.clone()
        best[:, 0] = torch.where(lucky, tokens[:, 1], best[:, 0])
        return accept(tokens, parents, ancestors, depths, best, max_depth)

    verifier.kernels = replace(verifier.kernels, accept_greedy=accept_biased)
    assert total_variation(sampled_law(biased, sampling, seeds, 1), exact) > bound
