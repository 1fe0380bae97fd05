"""Compiled programs (torch.compile/Inductor, regional: each decoder layer, the stem and head, and the
verifier's work around the target's forward) decode exactly the eager tokens."""

from conftest import EMBEDDED
from helpers import two_stage

from specgraph.program import Program


def test_compiled_and_eager_programs_give_identical_greedy_tokens():
    """Also a program compiled after another in the process: compiled code is shared by every
    program, and one whose KV pool has another size recompiles it; its kernels that write the cache
    (rotary + cache write, in Triton: the interpreter here) must still write each layer's slice
    (they wrote every layer's into layer 0's when the pool's size was left symbolic: GPU runs 99-100)."""
    def program(lowering: dict, tree: dict = {"shape": "chain", "length": 3}, **fields) -> Program:
        return Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft", tree, max_new_tokens=24,
                                             lowering=lowering, **fields))

    def compiled_regions(program: Program) -> list[bool]:
        """Which of the layers, the stem, the logits head, the verifier's placement and the work
        after the target's forward run through torch.compile."""
        model, runner = program.stages["target"].model, program.executor.runner
        return [getattr(model.layers[0], "_compiled_call_impl", None) is not None,
                *(hasattr(fn, "_torchdynamo_orig_callable")
                  for fn in (model.stem, model.logits, runner.verifier.placement, runner._settle))]

    compiled, eager = program({"compile": True}), program({"compile": False})
    assert [compiled.graph.node(s)["compile"] for s in ("draft", "target")] == [True, True]
    assert compiled_regions(compiled) == [True] * 5 and compiled_regions(eager) == [False] * 5
    expected = {}
    for text in ("import os\nimport sys\n", "def parse(path):\n    with open(path) as f:\n"):
        ids = compiled.encode(text)
        result = compiled.generate(ids)
        expected[text] = eager.generate(ids).output_ids
        assert result.output_ids == expected[text]
        assert max(result.accepted_lengths) > 1
    length = compiled.recipe.max_seq_len
    for max_seq_len in (2 * length, length // 2):  # pools of two other sizes, the second with the first's kernels
        after = program({"compile": True, "kernels": {"rope_write": "triton"}}, {"shape": "static", "branching": [2, 1]},
                        max_seq_len=max_seq_len)
        assert after.generate(after.encode(text)).output_ids == expected[text]  # (greedy: the target's own tokens)


def test_reference_attention_compiles_with_symbolic_grouped_heads():
    """Regional compilation marks head counts dynamic; grouped-query attention must still trace."""
    import torch

    from specgraph.kernels.attention import attention_reference

    from helpers import random_layout

    compiled = torch.compile(attention_reference, dynamic=True, fullgraph=True)
    layout = random_layout([3, 1, 4], [9, 2, 0], torch.Generator().manual_seed(0))
    slots = (layout.table.max() + 1) * layout.block_size
    q, k, v = torch.randn(1, 8, layout.tokens, 16), torch.randn(1, 2, slots, 16), torch.randn(1, 2, slots, 16)
    inputs = (q, k, v, *layout.attention_inputs(8))
    assert torch.allclose(compiled(*inputs), attention_reference(*inputs), atol=1e-5)


def test_a_compiled_engine_compiles_its_verification_once_for_every_batch_size():
    """The verifier's compiled work (the target's forward and what follows it) keeps a step's sizes
    symbolic: with forwards over the whole capacity (static shapes, as a GPU's captured steps run),
    decoding at every batch size from 1 to 5 compiles it at most three times (the first size, then
    symbolic sizes, then 1, which Dynamo specializes), not once a size. (It compiled once a size while
    the stage's test for a captured size put the step's token count in a Python set: on a GPU each
    compile of the Llama-3-8B shape's forward took tens of seconds, inside timed runs: GPU runs 103-107.)"""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from specgraph.engine.runner import Runner

    recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "chain", "length": 3}, max_new_tokens=6,
                       lowering={"compile": True}, serving={"max_batch": 5})
    before = len(_debug_get_cache_entry_list(Runner._settle.__code__))
    with Program.from_recipe(recipe) as program:
        for stage in program.stages.values():
            stage.static_shapes = True
        engine = program.executor
        prompts = [program.encode(text) for text in ("import os\n", "def f(x):\n", "class A:\n", "x = [1, 2]\n",
                                                     "for i in range(3):\n")]
        for batch in (5, 3):  # (each pass ends through every size below its own as its requests finish)
            engine.limit = batch
            for ids in prompts[:batch]:
                engine.add_request(ids, 6)
            while engine.busy:
                engine.step()
        assert len(_debug_get_cache_entry_list(Runner._settle.__code__)) - before <= 3  # (fewer after other programs)
