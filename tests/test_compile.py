"""Compiled decoder layers (torch.compile/Inductor, regional) decode exactly the eager tokens."""

from conftest import EMBEDDED
from helpers import two_stage

from specgraph.program import Program


def test_compiled_and_eager_programs_give_identical_greedy_tokens():
    def program(compile: bool) -> Program:
        return Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "chain", "length": 3},
                                             max_new_tokens=24, lowering={"compile": compile}))

    compiled, eager = program(True), program(False)
    assert [compiled.graph.node(s)["compile"] for s in ("draft", "target")] == [True, True]
    assert getattr(compiled.stages["target"].model.layers[0], "_compiled_call_impl", None) is not None
    assert getattr(eager.stages["target"].model.layers[0], "_compiled_call_impl", None) is None
    for text in ("import os\nimport sys\n", "def parse(path):\n    with open(path) as f:\n"):
        ids = compiled.encode(text)
        result = compiled.generate(ids)
        assert result.output_ids == eager.generate(ids).output_ids
        assert max(result.accepted_lengths) > 1
