"""Compiled programs (torch.compile/Inductor, regional: each decoder layer, the stem and head, and the
verifier's work around the target's forward) decode exactly the eager tokens."""

from conftest import EMBEDDED
from helpers import Cycling, two_stage

from specgraph.passes import plan
from specgraph.program import Program


def test_compiled_and_eager_programs_give_identical_greedy_tokens():
    """Also a program compiled after another in the process: compiled code is shared by every
    program, and one whose KV pool has another size recompiles it; its kernels that write the cache
    (rotary + cache write, in Triton: the interpreter here) must still write each layer's slice
    (they wrote every layer's into layer 0's when the pool's size was left symbolic: GPU runs 99-100).
    (A compiled drafter's exact tokens: test_a_compiled_sampling_program_draws_the_eager_tokens.)"""
    def recipe(lowering: dict, **fields):
        return two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "static", "branching": [2, 1]},
                         max_new_tokens=24, lowering=lowering, **fields)

    def compiled_regions(program: Program) -> list[bool]:
        """Which of the layers, the stem, the logits head, the verifier's placement and the work
        after the target's forward run through torch.compile."""
        model, runner = program.stages["target"].model, program.executor.runner
        return [getattr(model.layers[0], "_compiled_call_impl", None) is not None,
                *(hasattr(fn, "_torchdynamo_orig_callable")
                  for fn in (model.stem, model.logits, runner.verifier.placement, runner._settle))]

    planned = plan(recipe({"compile": True}))
    assert [planned.node(s)["compile"] for s in ("draft", "target")] == [True, True]
    eager = Program(plan(recipe({"compile": False})))
    assert compiled_regions(eager) == [False] * 5
    texts = ("import os\nimport sys\n", "def parse(path):\n    with open(path) as f:\n")
    expected = {text: eager.generate(eager.encode(text)).output_ids for text in texts}
    length = eager.recipe.max_seq_len
    for max_seq_len in (2 * length, length // 2):  # pools of two sizes, the second with the first's kernels
        graph = plan(recipe({"compile": True, "kernels": {"rope_write": "triton"}}, max_seq_len=max_seq_len))
        graph.node("draft")["compile"] = False  # (the target's compile is what is tested: a compile costs this CPU
        compiled = Program(graph)                # tens of seconds a shape)
        assert compiled_regions(compiled) == [True] * 5
        for text in texts:  # (a target writing one layer's slice gives other tokens)
            result = compiled.generate(compiled.encode(text))
            assert result.output_ids == expected[text]
            assert max(result.accepted_lengths) > 1


def test_a_failed_lowering_names_its_arguments_without_printing_their_ir():
    """Inductor formats a failed lowering's message (which it may catch and lower another way) from its
    arguments: an IR node's printing, every node it was built from, took minutes on an int4 target's
    verification work (GPU runs 114, 117); a compiled program's message names them by type and size."""
    import torch
    import torch._inductor.exc as exc

    from specgraph.lower import brief_lowering_errors

    class Node:  # (stands for an IR node: printing it is what must not happen)
        def get_size(self):
            return [4, 8]

        def __str__(self):
            raise AssertionError("the node was printed")

        __repr__ = __str__

    brief_lowering_errors()
    error = exc.LoweringException(ValueError("no lowering"), torch.ops.aten.mm.default, [Node(), 3], {})
    assert str(error) == "ValueError: no lowering\n  target: aten.mm.default, args: Node[4, 8], int"


def test_a_compiled_sampling_program_draws_the_eager_tokens():
    """Seeded sampling keys each token's noise by (seed, position), so a compiled program draws the
    eager program's tokens, seed for seed. (Inductor's code for the rule's work after the target's
    forward crashed the process on the CPU and ran for minutes a step on a GPU, GPU run 113: that
    work stays eager under the sampling rule; the layers are compiled.)"""
    def program(compile: bool) -> Program:
        return Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "chain", "length": 2},
                                             max_new_tokens=8, sampling={"temperature": 1.0, "top_k": 8},
                                             lowering={"compile": compile}))

    compiled, eager = program(True), program(False)
    assert hasattr(compiled.stages["target"].model.stem, "_torchdynamo_orig_callable")
    ids = compiled.encode("import os\nimport sys\n")
    for seed in range(3):
        assert compiled.generate(ids, seed=seed).output_ids == eager.generate(ids, seed=seed).output_ids


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


def test_a_compiled_engine_compiles_nothing_while_serving():
    """Every shape a run can meet is built with the engine (calibrate.warm_up): with forwards over
    the whole capacity (static shapes, as a GPU's captured steps run), requests that join one by one
    until four decode at once, then finish one by one, each step in the next of the policy's modes
    (plain decoding, chains of 3, 2 and 1), compile nothing more: Dynamo's count of compiled graphs
    stays where the build left it. (Compiles while serving cost a real model's shape tens of seconds
    each, inside timed runs: GPU runs 103-107, 111; a compile a batch size would fail this too.)"""
    from torch._dynamo.utils import counters

    recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "chain", "length": 3}, max_new_tokens=6,
                       lowering={"compile": True}, serving={"max_batch": 4, "speculation": "adaptive"})
    graph = plan(recipe)
    for name in graph.stages():
        graph.node(name)["static_shapes"] = True
    with Program(graph) as program:
        engine = program.executor
        engine.policy = Cycling(engine.runner.modes)
        built = counters["stats"]["unique_graphs"]
        texts = ("import os\n", "def f(x):\n    return x\n", "class A:\n", "x = [1, 2]\n", "for i in range(3):\n")
        for new, text in zip((12, 10, 8, 6, 3), texts):  # (joining one by one; the first finishes last)
            engine.add_request(program.encode(text), new)
            engine.step()
        while engine.busy:
            engine.step()
        assert set(engine.totals.modes) == {"ar", "depth 3", "depth 2", "depth 1"}
        assert counters["stats"]["unique_graphs"] == built > 0


def test_every_captured_shape_a_run_can_meet_is_built_with_the_engine():
    """Where steps are captured (a GPU), warm_up builds the rows of a step of any batch from 1 to
    max_batch, and a prompt forward in the bucket of any feed the engine can give: any number of
    newcomers up to max_batch, each at most the prefill share, at most prefill_chunk tokens in all
    (checked here for every such feed, at shares and chunks that are and are not powers of two)."""
    from types import SimpleNamespace

    from specgraph.engine.calibrate import prompt_shapes, step_shapes
    from specgraph.engine.runner import Runner, prompt_bucket

    for most, chunk, share in ((64, 512, 512), (5, 512, 100), (48, 300, 37), (3, 2048, 2048)):
        runner = SimpleNamespace(captured=True, stages=[SimpleNamespace(max_step_tokens=share)])
        runner.step_rows = lambda requests: Runner.step_rows(runner, requests)
        assert {runner.step_rows(c) for c in range(1, most + 1)} <= set(step_shapes(runner, most))
        built = {prompt_bucket(*shape) for shape in prompt_shapes(runner, most, chunk)}
        assert all(chunks <= tokens <= min(chunk, chunks * share) for chunks, tokens in prompt_shapes(runner, most, chunk))
        met = {prompt_bucket(chunks, tokens) for chunks in range(1, most + 1)
               for tokens in range(chunks, min(chunk, chunks * min(share, chunk)) + 1)}
        assert met <= built and len(built) == len(prompt_shapes(runner, most, chunk))
