"""Compiled decoder layers (torch.compile/Inductor, regional) decode exactly the eager tokens."""

from conftest import EMBEDDED
from helpers import two_stage

from specgraph.program import Program


def test_compiled_and_eager_programs_give_identical_greedy_tokens():
    recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "chain", "length": 3}, max_new_tokens=24)
    compiled, eager = Program.from_recipe(recipe, compile=True), Program.from_recipe(recipe, compile=False)
    assert compiled.compiled == {"draft": True, "target": True} and eager.compiled == {"draft": False, "target": False}
    for text in ("import os\nimport sys\n", "def parse(path):\n    with open(path) as f:\n"):
        ids = compiled.encode(text)
        result = compiled.generate(ids)
        assert result.output_ids == eager.generate(ids).output_ids
        assert max(result.accepted_lengths) > 1
