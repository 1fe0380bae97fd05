"""The Qwen3.5 hybrid target (gated DeltaNet + gated attention) against transformers on the
hybrid fixture, fp32 on the CPU: prompt logits, every tree node's logits, the state a commit
builds, and greedy speculative output token for token (16 held-out prompts x 128 new tokens)."""

import pytest
import torch
import transformers
from conftest import EMBEDDED, NEW_TOKENS, REPO, shared_models
from helpers import LONG_PROMPT, two_stage

from specgraph.models.loader import load_model
from specgraph.program import Program
from specgraph.runtime.stage import Stage, step_mask
from specgraph.tree import Tree

LOGIT_TOL = 1e-4  # fp32: transformers runs a prompt through its chunked algorithm, we through the closed form


@pytest.fixture(scope="module")
def hybrid():
    return shared_models() / "hybrid"


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
    tree = Tree(tokens=torch.randint(0, 4096, (9,)), parents=torch.tensor([-1, 0, 0, 1, 1, 2, 5, 6, 3]))
    stage = Stage("t", model, 64, torch.device("cpu"))
    with torch.no_grad():
        stage.prefill(prefix)
        logits = stage.forward(tree.tokens, 40 + tree.depths, 40 + torch.arange(9), step_mask(torch.tensor(40), tree.ancestors, 64))
        for node in range(tree.size):
            path = tree.ancestors[node].nonzero().flatten()
            assert (logits[node] - hf_last_logits(hf, torch.cat([prefix, tree.tokens[path]]))).abs().max() < LOGIT_TOL
        path = torch.tensor([0, 2, 5, 6, 7])
        stage.cache.commit(torch.cat([path, torch.tensor([-1, -1])]), 40)  # padded, as verification gives it
        following = torch.randint(0, 4096, (1,))
        mask = step_mask(torch.tensor(45), torch.ones(1, 1, dtype=torch.bool), 64)
        after = stage.forward(following, torch.tensor([45]), torch.tensor([45]), mask)[0]
    assert (after - hf_last_logits(hf, torch.cat([prefix, tree.tokens[path], following]))).abs().max() < LOGIT_TOL


@pytest.fixture(scope="module")
def reference(hybrid_reference):
    return hybrid_reference


@pytest.mark.parametrize("drafter, tree", [
    ("draft", {"shape": "chain", "length": 4}),
    ("draft", {"shape": "static", "branching": [3, 2, 1, 1]}),
    ("draft", {"shape": "dynamic", "width": 4, "depth": 5, "nodes": 24}),
    ("mid", {"shape": "static", "branching": [3, 2, 1, 1]}),
])
def test_greedy_output_equals_the_hybrid_target_alone(hybrid, reference, drafter, tree):
    draft = EMBEDDED / "draft" if drafter == "draft" else shared_models() / "mid"
    program = Program.from_recipe(two_stage(hybrid, draft, tree, max_new_tokens=NEW_TOKENS))
    accepted = []
    for ids, expected in reference:
        generation = program.generate(ids)
        assert generation.output_ids == expected
        accepted += generation.accepted_lengths
    assert sum(accepted) / len(accepted) > 1.5


def test_fused_gated_delta_kernels_decode_the_tokens_of_transformers(hybrid, reference):
    """The Triton gated-DeltaNet step and commit, chosen per op (the other ops stay the references;
    interpreted on the CPU, hence one prompt): a tree recipe's greedy tokens are transformers'."""
    from specgraph.kernels.gated_delta.triton import gated_delta_commit, gated_delta_step
    fused = {"gated_delta_step": "triton", "gated_delta_commit": "triton"}
    program = Program.from_recipe(two_stage(hybrid, EMBEDDED / "draft", {"shape": "static", "branching": [3, 2, 1, 1]},
                                            max_new_tokens=32, lowering={"kernels": fused}))
    target = program.stages["target"]
    assert target.cache.kernels.gated_delta_commit is gated_delta_commit
    assert target.model.layers[0].linear_attn.kernels.gated_delta_step is gated_delta_step
    ids, expected = reference[0]
    generation = program.generate(ids)
    assert generation.output_ids == expected[:32] and max(generation.accepted_lengths) > 1


def test_autoregressive_hybrid_equals_transformers(hybrid, reference):
    program = Program.from_recipe(two_stage(hybrid, None, max_new_tokens=NEW_TOKENS))
    for ids, expected in reference[:2]:
        assert program.generate(ids).output_ids == expected


def test_hybrid_recipe_runs_from_the_cli_and_its_exported_program_decodes_the_same_tokens(tmp_path):
    """The recipe runs from the CLI; `specgraph compile` exports the hybrid target with its
    recurrent state among the step program's inputs, and the packages, loaded in a fresh process,
    decode a prompt longer than one package step (so prefilled in chunks) as the eager program does
    (the tokens: acceptance may differ where compiled and eager draft logits round a near-tie apart);
    loaded here, one-token steps through the package decode as the eager target alone does."""
    import json
    import subprocess
    import sys

    from specgraph.cli import main
    from specgraph.export import load_program
    from specgraph.recipe import Recipe

    recipe = REPO / "recipes" / "hybrid.yaml"
    shared_models()  # the recipe's target lives in ../shared
    out = tmp_path / "run.json"
    assert main(["run", str(recipe), "--prompt", LONG_PROMPT, "--max-new-tokens", "24", "--json", str(out)]) == 0
    eager = json.loads(out.read_text())["results"][0]
    assert eager["prompt_tokens"] > 64
    program = tmp_path / "program"
    assert main(["compile", str(recipe), "-o", str(program), "--set", "max_seq_len=256"]) == 0
    assert json.loads((program / "manifest.json").read_text())["stages"]["target"]["hybrid"]
    result = tmp_path / "exported.json"
    proc = subprocess.run([sys.executable, "-m", "specgraph.cli", "run", "--program", str(program), "--prompt", LONG_PROMPT,
                           "--max-new-tokens", "24", "--json", str(result)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(result.read_text())["results"][0]["output_ids"] == eager["output_ids"]
    loaded, reference = load_program(program), Program.from_recipe(Recipe.from_yaml(recipe, ["max_seq_len=256"]))
    ids = reference.encode(LONG_PROMPT)
    assert loaded.autoregressive().generate(ids, 16).output_ids == reference.autoregressive().generate(ids, 16).output_ids
