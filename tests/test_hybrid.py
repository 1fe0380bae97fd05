"""The Qwen3.5 hybrid (gated DeltaNet + gated attention) against transformers on the hybrid
fixture, fp32 on the CPU: prompt logits, every tree node's logits, the state a commit builds,
greedy speculative output token for token (16 held-out prompts x 128 new tokens); and a small
hybrid (the fixture's first four layers) drafting for it: its trees are its own model's, by
transformers, after any verdicts."""

import random

import pytest
import torch
import transformers
from conftest import EMBEDDED, NEW_TOKENS, REPO, shared_model
from helpers import LONG_PROMPT, as_vision_language, grown_on_the_host, hf_greedy, run_noting_projections, two_stage

from specgraph.draft import Drafter, Requests
from specgraph.kernels.gumbel import perturbed_top_reference
from specgraph.models.loader import load_model
from specgraph.recipe import DynamicTree, SamplingSpec, StaticTree
from specgraph.program import Program
from specgraph.runtime.stage import Stage
from specgraph.sampling import SamplingRows, perturbed_top
from specgraph.tree import Tree, TreeTopology

LOGIT_TOL = 1e-4  # fp32: transformers runs a prompt through its chunked algorithm, we through the closed form


@pytest.fixture(scope="module")
def hybrid():
    return shared_model("hybrid")


@pytest.fixture(scope="module")
def hf(hybrid):
    return transformers.AutoModelForCausalLM.from_pretrained(hybrid, dtype=torch.float32).eval()


@torch.no_grad()
def hf_last_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None]).logits[0, -1]


def test_prompt_logits_match_transformers_across_prefill_chunks(hybrid, hf):
    ids = torch.randint(0, 4096, (300,))  # three chunks of at most 128 tokens, each committed
    stage = Stage("t", load_model(hybrid, torch.float32, "cpu"), 320, torch.device("cpu"))
    with torch.no_grad():
        ours = stage.prefill(ids)
        ref = hf(ids[None]).logits[0]
    assert (ours - ref).abs().max() < LOGIT_TOL


def test_tree_nodes_and_committed_state_match_each_path_run_alone(hybrid, hf):
    """Every node of a tree step sees exactly its root-to-node path; committing one path leaves the
    state (and conv window) from which the next token's logits equal the path run alone."""
    model = load_model(hybrid, torch.float32, "cpu")
    prefix = torch.randint(0, 4096, (40,))
    tree = Tree(tokens=torch.randint(0, 4096, (1, 9)), parents=torch.tensor([[-1, 0, 0, 1, 1, 2, 5, 6, 3]]))
    stage = Stage("t", model, 64, torch.device("cpu"))
    with torch.no_grad():
        stage.prefill(prefix)
        logits = stage.forward_one(tree.tokens[0], 40 + tree.depths[0], torch.tensor(40), torch.arange(9),
                                   tree.ancestors[0], 64)
        for node in range(tree.size):
            path = tree.ancestors[0, node].nonzero().flatten()
            assert (logits[node] - hf_last_logits(hf, torch.cat([prefix, tree.tokens[0, path]]))).abs().max() < LOGIT_TOL
        path = torch.tensor([0, 2, 5, 6, 7])
        stage.cache.commit(stage.table, torch.zeros(1, dtype=torch.long), torch.cat([path, torch.tensor([-1, -1])])[None], torch.tensor([40]))  # padded, as verification gives it
        following = torch.randint(0, 4096, (1,))
        after = stage.forward_one(following, torch.tensor([45]), torch.tensor(45), torch.tensor([0]),
                                  torch.ones(1, 1, dtype=torch.bool), 64)[0]
    assert (after - hf_last_logits(hf, torch.cat([prefix, tree.tokens[0, path], following]))).abs().max() < LOGIT_TOL


@pytest.fixture(scope="module")
def reference(hybrid_reference):
    return hybrid_reference


@pytest.mark.parametrize("drafter, tree", [
    ("draft", {"shape": "chain", "length": 4}),
    ("draft", {"shape": "static", "branching": [3, 2, 1, 1]}),
    ("draft", {"shape": "dynamic", "width": 4, "depth": 5, "nodes": 24}),
    ("small hybrid", {"shape": "dynamic", "width": 4, "depth": 5, "nodes": 24}),
])
def test_greedy_output_equals_the_hybrid_target_alone(hybrid, reference, drafter, tree, request):
    draft = EMBEDDED / "draft" if drafter == "draft" else request.getfixturevalue("small_hybrid")
    program = Program.from_recipe(two_stage(hybrid, draft, tree, max_new_tokens=NEW_TOKENS))
    accepted = []
    for ids, expected in reference if drafter == "draft" else reference[:4]:  # a hybrid drafter is slow on the CPU
        generation = program.generate(ids)
        assert generation.output_ids == expected
        accepted += generation.accepted_lengths
    assert sum(accepted) / len(accepted) > 1.5


def static_tree_by_definition(logits_after, committed: torch.Tensor, topo: TreeTopology) -> list[int]:
    """A static tree's tokens by definition: each node's children are the top-k after its path."""
    tokens = [int(committed[-1])] + [0] * topo.nodes
    for node in range(len(topo.parents)):
        kids = topo.children(node)
        if kids:
            path, u = [], node
            while u > 0:
                path, u = [tokens[u]] + path, topo.parents[u]
            best = logits_after(torch.cat([committed, torch.tensor(path, dtype=torch.long)])).topk(len(kids)).indices
            for kid, token in zip(kids, best.tolist()):
                tokens[kid] = token
    return tokens


@pytest.mark.parametrize("plan", [TreeTopology.from_spec(StaticTree(branching=[3, 2, 1])),
                                  DynamicTree(width=3, depth=3, nodes=8)], ids=["static", "dynamic"])
def test_a_hybrid_drafter_grows_its_own_models_trees_after_any_verdicts(small_hybrid, plan):
    """Over steps with random verdicts (nothing, some or a whole branch accepted, a random bonus),
    from a one-token prompt (its first catch-up feeds one token and its first verdict accepts
    nothing, so nothing is folded) and a longer one: every tree is the one its model, run by
    transformers over the committed tokens and each node's path, defines; under the sampling rule,
    each node's children are the perturbed top-k of that node's distribution."""
    hf_small = transformers.AutoModelForCausalLM.from_pretrained(small_hybrid, dtype=torch.float32).eval()
    logits_after = torch.no_grad()(lambda ids: hf_small(ids[None]).logits[0, -1])
    d = Drafter(Stage("draft", load_model(small_hybrid, torch.float32, "cpu"), 160, torch.device("cpu")), plan, "greedy")
    rows = SamplingRows.of([SamplingSpec(temperature=1.0, top_k=20)], "cpu")
    sampler = Drafter(d.stage, plan, "sampling") if isinstance(plan, TreeTopology) else None
    rng = random.Random(1)
    for committed in ([17], torch.randint(0, 4096, (30,)).tolist()):
        buffer = torch.zeros(128, dtype=torch.long)
        buffer[: len(committed)] = torch.tensor(committed)
        d.prefill(torch.tensor(committed))
        for step in range(6):
            length, ids = len(committed), torch.tensor(committed)
            request = Requests.one(buffer, torch.tensor(length), min(2, length))
            if sampler is not None:  # (before the draft that is committed: a commit folds the last forward's factors)
                drawn = sampler.draft(request, d.stage.width(length, 40), rows).tree
                for node in filter(drawn.children, range(drawn.size)):
                    path, kids = drawn.ancestors[0, node].nonzero().flatten()[1:], drawn.children(node)
                    logits = logits_after(torch.cat([ids, drawn.tokens[0, path]]))  # [V]
                    at = torch.tensor([[length + path.numel()]])  # the children's sequence index
                    expected = perturbed_top(logits[None, None], rows, at, len(kids), perturbed_top_reference)[0]
                    assert drawn.tokens[0, kids].tolist() == expected[0, 0].tolist()
            draft = d.draft(request, d.stage.width(length, 40))
            tree = draft.tree
            if isinstance(plan, DynamicTree):
                assert (tree.tokens[0].tolist(), tree.parents[0].tolist()) == grown_on_the_host(logits_after, ids, plan)
            else:
                assert tree.tokens[0].tolist() == static_tree_by_definition(logits_after, ids, plan)
            path = [0]
            while tree.children(path[-1]) and (step > 0 or length > 1) and rng.random() < 0.7:
                path.append(rng.choice(tree.children(path[-1])))
            new = tree.tokens[0, path[1:]].tolist() + [rng.randrange(4096)]
            d.commit(draft, torch.tensor([path + [-1] * (d.max_depth + 1 - len(path))]), request)
            committed += new
            buffer[: len(committed)] = torch.tensor(committed)


@pytest.mark.parametrize("target, lowering, chars, tokens", [
    ("small_hybrid", {"kernels": {"gated_delta_step": "triton"}}, 80, 8),
    ("small_hybrid", {"kernels": "reference", "row_invariant": True}, 40, 4),  # more kernels interpreted: shorter
], ids=["closed-form", "row-invariant"])
def test_fused_gated_delta_kernels_decode_the_tokens_of_transformers(target, code_prompts, lowering, chars, tokens,
                                                                     request):
    """The Triton gated-DeltaNet step and commit — the closed form chosen per op, or with
    lowering.row_invariant the target's node-by-node walk, its per-head norms, projections and
    attention (the other ops stay the references; on the fixture's first four layers, interpreted
    on the CPU, hence one short prompt): a tree recipe's greedy tokens are transformers'."""
    hybrid = request.getfixturevalue(target)
    from specgraph.kernels.gated_delta import invariant, triton
    module = invariant if lowering.get("row_invariant") else triton
    suffix = "_invariant" if lowering.get("row_invariant") else ""
    program = Program.from_recipe(two_stage(hybrid, EMBEDDED / "draft", {"shape": "static", "branching": [3, 2, 1, 1]},
                                            max_new_tokens=tokens, lowering=lowering))
    target = program.stages["target"]
    assert target.cache.kernels.gated_delta_commit is getattr(module, f"gated_delta_commit{suffix}")
    assert target.model.layers[0].linear_attn.kernels.gated_delta_step is getattr(module, f"gated_delta_step{suffix}")
    [(ids, expected)] = hf_greedy(hybrid, [{"prompt": code_prompts[0]["prompt"][:chars]}], tokens)
    generation, unprojected = run_noting_projections(target.model, lambda: program.generate(ids))
    assert generation.output_ids == expected and max(generation.accepted_lengths) > 1
    assert not unprojected  # qkv and the DeltaNet's in_proj too


def test_autoregressive_hybrid_equals_transformers(hybrid, reference):
    program = Program.from_recipe(two_stage(hybrid, None, max_new_tokens=NEW_TOKENS))
    for ids, expected in reference[:2]:
        assert program.generate(ids).output_ids == expected


def test_a_vision_language_checkpoint_decodes_as_its_text_model(hybrid, reference, tmp_path):
    """Qwen3.5 as published: the text model runs (the vision tower and mtp.* are never loaded), and
    decodes what transformers decodes, from this layout and from the text-only fixture."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    folder = as_vision_language(hybrid, tmp_path / "vision-language")
    hf_vl = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    ids, expected = reference[0]
    assert hf_vl.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist() == expected[:8]
    program = Program.from_recipe(two_stage(folder, EMBEDDED / "draft", {"shape": "chain", "length": 4},
                                            max_new_tokens=32))
    assert program.generate(ids).output_ids == expected[:32]


def test_hybrid_recipe_runs_from_the_cli_and_its_exported_program_decodes_the_same_tokens(tmp_path):
    """The recipe runs from the CLI; `specgraph compile` exports the hybrid target with its
    recurrent state among the step program's inputs, and the packages, loaded in a fresh process,
    decode a prompt longer than one package step (so prefilled in chunks): each the tokens of
    transformers' greedy decoding (acceptance may differ where compiled and eager draft logits round
    a near-tie apart); loaded here, one-token steps through the package decode them too."""
    import json
    import subprocess
    import sys

    from specgraph.cli import main
    from specgraph.export import load_program

    recipe = REPO / "recipes" / "hybrid.yaml"
    [(ids, expected)] = hf_greedy(shared_model("hybrid"), [{"prompt": LONG_PROMPT}], 24)  # (the recipe's target)
    out = tmp_path / "run.json"
    assert main(["run", str(recipe), "--prompt", LONG_PROMPT, "--max-new-tokens", "24", "--json", str(out)]) == 0
    eager = json.loads(out.read_text())["results"][0]
    assert eager["prompt_tokens"] == len(ids) > 64 and eager["output_ids"] == expected
    program = tmp_path / "program"
    assert main(["compile", str(recipe), "-o", str(program), "--set", "max_seq_len=256"]) == 0
    assert json.loads((program / "manifest.json").read_text())["stages"]["target"]["hybrid"]
    result = tmp_path / "exported.json"
    proc = subprocess.run([sys.executable, "-m", "specgraph.cli", "run", "--program", str(program), "--prompt", LONG_PROMPT,
                           "--max-new-tokens", "24", "--json", str(result)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(result.read_text())["results"][0]["output_ids"] == expected
    loaded = load_program(program)  # (held: its packages must outlive the engine that runs them)
    assert loaded.autoregressive().generate(ids, 16).output_ids == expected[:16]


def test_a_hybrid_drafter_starts_each_request_from_a_fresh_state(small_hybrid):
    """Drafter.prefill (what every executor's drafter calls per request) resets the request's
    DeltaNet state and conv window: after another prompt, the state equals a fresh stage's."""
    model = load_model(small_hybrid, torch.float32, "cpu")
    used, fresh = (Drafter(Stage(name, model, 64, torch.device("cpu")), TreeTopology.from_spec(StaticTree(
        branching=[2])), "greedy") for name in ("used", "fresh"))
    first, second = torch.randint(0, 4096, (9,)), torch.randint(0, 4096, (3,))
    used.prefill(first)
    used.prefill(second)  # (its one fed token would fold into the first prompt's state, were it not reset)
    fresh.prefill(second)
    assert torch.equal(used.stage.cache.state, fresh.stage.cache.state)
    assert torch.equal(used.stage.cache.conv, fresh.stage.cache.conv)
