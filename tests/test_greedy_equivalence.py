"""Greedy speculative decoding equals transformers' greedy decoding of the target, token for token,
in fp32 on the CPU: 16 held-out code prompts x 128 new tokens, for every tree shape and drafter."""

import pytest
from conftest import EMBEDDED, NEW_TOKENS, shared_model
from helpers import two_stage

from specgraph.program import Program

TREES = {
    "chain": {"shape": "chain", "length": 4},
    "static": {"shape": "static", "branching": [3, 2, 1, 1]},
    "dynamic": {"shape": "dynamic", "width": 4, "depth": 5, "nodes": 24},
}


@pytest.fixture(scope="module")
def reference(target_reference):
    return target_reference


def drafter_path(name):
    return EMBEDDED / "draft" if name == "draft" else shared_model("mid")


@pytest.mark.parametrize("drafter", ["draft", "mid"])
@pytest.mark.parametrize("shape", list(TREES))
def test_greedy_output_equals_the_target_alone(reference, drafter, shape):
    program = Program.from_recipe(two_stage(EMBEDDED / "target", drafter_path(drafter), TREES[shape],
                                            max_new_tokens=NEW_TOKENS))
    accepted = []
    for ids, expected in reference:
        generation = program.generate(ids)
        assert generation.output_ids == expected
        accepted += generation.accepted_lengths
    assert sum(accepted) / len(accepted) > 1.5  # the drafts are really being accepted


def test_autoregressive_recipe_equals_the_target_alone(reference):
    program = Program.from_recipe(two_stage(EMBEDDED / "target", None, max_new_tokens=NEW_TOKENS))
    for ids, expected in reference[:4]:
        generation = program.generate(ids)
        assert generation.output_ids == expected and set(generation.accepted_lengths) == {1}
