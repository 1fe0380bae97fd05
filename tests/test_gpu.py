"""On a GPU: CUDA-graph replay gives the same tokens as eager forwards, and speculation in bf16
gives the tokens of our own autoregressive decoding of the same program where it is exact."""

import json
import subprocess
import sys
from unittest import mock

import pytest
import torch
from conftest import EMBEDDED, NEW_TOKENS, REPO, shared_model
from conftest import PROMPTS as HELD_OUT
from helpers import one_token_steps, path_alone, random_layout, sampled_law, total_variation, two_stage, two_token_law

from specgraph.export import export_program
from specgraph.program import Program
from specgraph.recipe import Recipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Tree:\n    \"\"\"A rooted tree.\"\"\"\n\n    def __init__(self"]


def on_gpu(tree: dict, target=EMBEDDED / "target", **fields) -> Program:
    recipe = two_stage(target, EMBEDDED / "draft", tree, **fields)
    recipe = recipe.model_copy(update={"stages": [s.model_copy(update={"devices": ["cuda:0"]}) for s in recipe.stages]})
    return Program.from_recipe(recipe)


def steps_without_host_sync(engine, steps: int = 4) -> int:
    """`steps` steady engine steps of a long request under sync debug mode "error", which raises on
    any host synchronisation but the one a step is allowed: the wait for the event of the step it
    collects (the step launched before, whose result then lies in pinned memory) -> the tokens they gave."""
    request = engine.add_request([1, 2, 3, 4, 5], 64)
    while request.steps < 2:  # prompt in, graphs captured
        engine.step()
    torch.cuda.synchronize()
    wait = torch.cuda.Event.synchronize

    def the_one_wait(event):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return wait(event)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    tokens = len(request.generation.output_ids)
    with mock.patch.object(torch.cuda.Event, "synchronize", the_one_wait):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    engine.abort(request.id)
    while engine.busy:
        engine.step()
    return len(request.generation.output_ids) - tokens


def phases(engine) -> set[str]:
    """The step phases the engine replays from CUDA graphs."""
    return {key[0] for key in engine.runner._replays.graphs}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tree", [{"shape": "static", "branching": [2, 2, 1]}, {"shape": "dynamic", "width": 3, "depth": 3, "nodes": 8}],
                         ids=["static", "dynamic"])
def test_cuda_graphs_replay_the_eager_program(dtype, tree):
    graphed = on_gpu(tree, dtype=dtype, max_new_tokens=64, lowering={"compile": False})
    eager = on_gpu(tree, dtype=dtype, max_new_tokens=64, lowering={"compile": False, "cuda_graphs": False})
    for text in PROMPTS:
        ids = graphed.encode(text)
        assert graphed.generate(ids).output_ids == eager.generate(ids).output_ids
    assert phases(graphed.executor) == {"prefill", "draft", "verify"}  # prompt chunks and whole steps captured
    assert not phases(eager.executor) and not eager.stages["target"]._replays.graphs


@pytest.mark.parametrize("lowering", [{}, {"compile": False, "cuda_graphs": False}], ids=["captured", "eager"])
def test_steady_steps_never_wait_for_the_host(lowering):
    """The engine's steps of a tree recipe (every step speculating) and of `ar`: each launched before
    the last is read, nothing copied from pageable memory, no host read but the collected step's event."""
    program = on_gpu({"shape": "static", "branching": [2, 2, 1]}, max_new_tokens=8, lowering=lowering,
                     serving={"speculation": "always"})
    assert steps_without_host_sync(program.executor) >= 4
    assert steps_without_host_sync(program.autoregressive()) == 4


def test_sampling_on_gpu_follows_the_target_distribution():
    """fp32 on the GPU, the Triton acceptance kernel: two sampled tokens over many seeds approach
    the target's exact law (computed on the CPU), far below the draft's own distance to it."""
    sampling = {"temperature": 1.0, "top_k": 3}
    program = on_gpu({"shape": "static", "branching": [2, 2]}, max_new_tokens=2, sampling=sampling)
    assert program.graph.node("target")["step_graphs"]  # draws are counter-based: a sampling step is captured too
    ids = program.encode("import os\nimport sys\n\n\ndef main(")
    observed = sampled_law(lambda seed: program.generate(ids, seed=seed).output_ids, 1200)
    exact, draft = two_token_law(EMBEDDED / "target", ids, sampling), two_token_law(EMBEDDED / "draft", ids, sampling)
    assert set(observed) <= set(exact)
    assert total_variation(observed, exact) < 0.06 < total_variation(draft, exact) / 4


def test_fp32_speculation_on_gpu_equals_autoregressive_alone_and_in_a_batch():
    program = on_gpu({"shape": "chain", "length": 4}, max_new_tokens=64)
    batched = on_gpu({"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}, max_new_tokens=64,
                     serving={"max_batch": 4})
    encoded = [program.encode(text) for text in PROMPTS]
    alone = [program.generate(ids).output_ids for ids in encoded]
    assert alone == [program.autoregressive().generate(ids, 64).output_ids for ids in encoded]
    together = dict(batched.generate_many(encoded * 2))  # four requests at once, graphs of batch 4 and fewer
    assert [together[i].output_ids for i in range(4)] == alone * 2


def decoded_together(engine, reference) -> list[list[int]]:
    """Every reference prompt through `engine` at once (up to its batch limit), each for its reference's length."""
    requests = [engine.add_request(ids, len(new)) for ids, new in reference]
    while engine.busy:
        engine.step()
    return [r.generation.output_ids for r in requests]


@pytest.mark.parametrize("system", ["ar", "dynamic"])
def test_fp32_on_gpu_decodes_the_greedy_tokens_of_transformers(system, target_reference):
    """An oracle that shares none of our code: transformers' greedy tokens (fp32, on the CPU) for 16 held-out
    prompts x 128, against our compiled, captured fp32 program on the GPU, one request at a time and four at once
    (fp32 attention computed in TF32 passed every GPU test whose oracle was our own `ar`: c12878d)."""
    program = on_gpu({"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}, max_new_tokens=NEW_TOKENS,
                     serving={"max_batch": 4})
    engine = program.autoregressive() if system == "ar" else program.executor
    expected = [new for _, new in target_reference]
    alone = [engine.generate(ids, len(new)).output_ids for ids, new in target_reference]
    assert alone == expected
    assert decoded_together(engine, target_reference) == expected


def test_compiled_layers_give_the_eager_tokens_on_gpu():
    tree = {"shape": "chain", "length": 4}
    compiled = on_gpu(tree, max_new_tokens=48)  # compiled by default on a GPU
    eager = on_gpu(tree, max_new_tokens=48, lowering={"compile": False})
    assert compiled.graph.node("target")["compile"] and not eager.graph.node("target")["compile"]
    for text in PROMPTS:
        ids = compiled.encode(text)
        assert compiled.generate(ids).output_ids == eager.generate(ids).output_ids


def aoti_loads_a_package(folder) -> bool:
    """Whether AOTInductor here loads a one-layer CUDA package (in a fresh process: it can crash)."""
    exported = torch.export.export(torch.nn.Linear(8, 8).cuda(), (torch.randn(2, 8, device="cuda"),))
    package = str(folder / "linear.pt2")
    torch._inductor.aoti_compile_and_package(exported, package_path=package)
    load = "import sys, torch; torch._inductor.aoti_load_package(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", load, package], capture_output=True).returncode == 0


def test_exported_program_on_gpu_gives_the_eager_tokens(tmp_path):
    if not aoti_loads_a_package(tmp_path):  # torch 2.11+cu130 on our H200s: docs/benchmarks.md, run 34
        pytest.skip("this torch's AOTInductor cannot load even a one-layer CUDA package (the process crashes)")
    tree = {"shape": "chain", "length": 4}
    export_program(on_gpu(tree, max_new_tokens=32, max_seq_len=300), tmp_path / "program")
    result = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "specgraph.cli", "run", "--program", str(tmp_path / "program"),
                           "--prompt", PROMPTS[0], "--max-new-tokens", "32", "--json", str(result)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    eager = on_gpu(tree, max_new_tokens=32, max_seq_len=300, lowering={"compile": False, "kernels": "reference"})
    expected = eager.generate(eager.encode(PROMPTS[0])).output_ids
    assert json.loads(result.read_text())["results"][0]["output_ids"] == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_target_on_two_gpus_decodes_the_single_gpu_tokens(tmp_path):
    """fp32; draft and target split over cuda:0 and cuda:1 (NCCL all-reduces inside captured steps)."""
    import json

    from helpers import PROMPT, splittable_recipe

    from specgraph.cli import main
    from specgraph.recipe import Recipe

    recipe = splittable_recipe(tmp_path, devices="cuda:0")
    always = "serving.speculation=always"  # (the adaptive policy's steps follow each program's measured times)
    single = Program.from_recipe(Recipe.from_yaml(recipe, [always]))
    expected = single.generate(single.encode(PROMPT)).output_ids
    out = tmp_path / "tp.json"
    split = "[cuda:0,cuda:1]"
    assert main(["run", str(recipe), "--set", f"stages.0.devices={split}", "--set", f"stages.1.devices={split}",
                 "--set", always, "--prompt", PROMPT, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["output_ids"] == expected


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_hybrid_target_on_two_gpus_decodes_the_tokens_of_transformers(hybrid_reference):
    """fp32; the Qwen3.5 fixture and its drafter split over cuda:0 and cuda:1 (Triton gated-DeltaNet
    kernels, NCCL all-reduces in captured steps; a process runs its stages on one device)."""
    recipe = two_stage(shared_model("hybrid"), EMBEDDED / "draft", {"shape": "static", "branching": [3, 2, 1]},
                       max_new_tokens=48).model_dump(mode="json")
    for stage in recipe["stages"]:
        stage["devices"] = ["cuda:0", "cuda:1"]
    ids, expected = hybrid_reference[0]
    with Program.from_recipe(Recipe.from_dict(recipe)) as split:
        assert split.generate(ids).output_ids == expected[:48]


def test_hybrid_target_captured_and_compiled_gives_the_eager_tokens_and_never_waits():
    """fp32; the Qwen3.5 target's whole steps captured, its layers compiled, Triton kernels, against
    eager forwards of the reference kernels; then a captured step under sync debug mode."""
    tree = {"shape": "static", "branching": [3, 2, 1, 1]}
    fast = on_gpu(tree, shared_model("hybrid"), max_new_tokens=64)
    slow = on_gpu(tree, shared_model("hybrid"), max_new_tokens=64,
                  lowering={"compile": False, "cuda_graphs": False, "kernels": "reference"})
    for text in PROMPTS:
        ids = fast.encode(text)
        assert fast.generate(ids).output_ids == slow.generate(ids).output_ids
    assert phases(fast.executor) == {"prefill", "draft", "verify"}  # prompt chunks and whole steps captured
    assert steps_without_host_sync(fast.executor) >= 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_kernel_gives_every_node_the_recurrence_along_its_path(dtype):
    """The fused gated-DeltaNet step at the Qwen3.5 layer shapes (head dims 128) against the token-by-token
    recurrence from each node's parent's state (scripts/bench_gated_delta.py's branch way, fed the same gates),
    over chains, bushy and deep trees of 1 to 128 nodes and several random layers."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_gated_delta import branch_by_branch, layer_inputs, tree_levels

    from specgraph.models.widen import QWEN35_REAL
    from specgraph.kernels.gated_delta.triton import gated_delta_step
    from specgraph.tree import Tree

    generator, device = torch.Generator().manual_seed(0), torch.device("cuda")
    for shape in QWEN35_REAL.values():
        for t, depth in [(1, 1), (16, 16), (64, 3), (64, 8), (128, 16), (128, 128)]:
            tree = Tree.random(t, depth, generator)
            for _ in range(2):
                args, steps = layer_inputs(shape, [tree], generator, device, dtype)
                exact = branch_by_branch(args, tree_levels(tree, device))
                got = gated_delta_step(*args, *steps).float()
                cosine = torch.nn.functional.cosine_similarity(got.flatten(2), exact.flatten(2), dim=-1)  # per node
                error = (got - exact).abs().max() / exact.abs().max()
                assert error < (1e-4 if dtype == torch.float32 else 2e-2) and cosine.min() > 0.999, (t, depth, error)


@pytest.mark.parametrize("closed_form", [False, True], ids=["walk", "closed-form"])
def test_hybrid_with_the_fused_gated_delta_kernels_equals_transformers(hybrid_reference, closed_form):
    """fp32 on the GPU, Triton kernels (auto: the walking gated-DeltaNet step; or the closed form),
    the hybrid fixture: the tree recipe's greedy tokens are transformers' on 16 prompts x 128 tokens."""
    from specgraph.kernels.gated_delta.invariant import gated_delta_step_invariant
    from specgraph.kernels.gated_delta.triton import gated_delta_step
    lowering = {"kernels": {"gated_delta_step": "triton"}} if closed_form else {}
    program = on_gpu({"shape": "dynamic", "width": 4, "depth": 5, "nodes": 24}, shared_model("hybrid"),
                     max_new_tokens=128, dtype="float32", lowering=lowering)
    from specgraph.kernels.gated_delta.invariant import gated_delta_commit_invariant
    from specgraph.kernels.gated_delta.triton import gated_delta_commit
    target = program.stages["target"]
    assert target.model.layers[0].linear_attn.kernels.gated_delta_step is (
        gated_delta_step if closed_form else gated_delta_step_invariant)
    assert target.cache.kernels.gated_delta_commit is (gated_delta_commit if closed_form else gated_delta_commit_invariant)
    for ids, expected in hybrid_reference:
        assert program.generate(ids).output_ids == expected


def test_a_hybrid_drafter_captured_on_the_gpu_equals_transformers(small_hybrid, hybrid_reference):
    """fp32, Triton kernels, whole steps captured: a small hybrid (re-feeding its catch-up and fed
    nodes with each expansion) drafts dynamic trees for the hybrid fixture; its greedy tokens are
    transformers', and a step reads nothing on the host."""
    recipe = two_stage(shared_model("hybrid"), small_hybrid, {"shape": "dynamic", "width": 4, "depth": 5, "nodes": 24},
                       max_new_tokens=128, dtype="float32")
    program = Program.from_recipe(recipe.model_copy(update={"stages": [
        s.model_copy(update={"devices": ["cuda:0"]}) for s in recipe.stages]}))
    for ids, expected in hybrid_reference[:4]:
        assert program.generate(ids).output_ids == expected
    assert phases(program.executor) == {"prefill", "draft", "verify"}
    assert steps_without_host_sync(program.executor) >= 4


def test_row_invariant_kernels_give_a_token_the_same_bits_in_any_step_in_bf16():
    """bf16: every row of the row-invariant projection and SwiGLU at 2-128 rows (K split or not) is,
    bit for bit, the row projected alone, as is every row of add + RMSNorm and of the per-head
    RMSNorm; every node of a 21-node tree's attention over a 700-token prefix, packed with two
    other requests in a paged pool, is the node decoded alone with its path committed; every node
    of a gated-DeltaNet step (Qwen3.5-9B and 27B layer shapes) is the node decoded by one-token
    steps along its path, and committing a path leaves their state and conv window."""
    from specgraph.kernels.attention.invariant import attention_invariant
    from specgraph.kernels.gated_delta.invariant import gated_delta_commit_invariant, gated_delta_step_invariant
    from specgraph.kernels.linear.invariant import linear_invariant
    from specgraph.kernels.norm.triton import add_rmsnorm, rmsnorm
    from specgraph.kernels.swiglu.invariant import swiglu_invariant

    g = torch.Generator(device="cuda").manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    for n, k in [(1536, 1024), (1024, 8192)]:
        weight, bias = torch.randn(n, k, **bf16) / k ** 0.5, torch.randn(n, **bf16)
        for rows in (2, 21, 128):
            x = torch.randn(rows, k, **bf16)
            for op, b in [(linear_invariant, bias), (linear_invariant, None), (swiglu_invariant, None)]:
                whole = op(x, weight, b)
                assert all(torch.equal(whole[i], op(x[i], weight, b)) for i in range(rows)), (op, n, k, rows)
    x, delta, w = torch.randn(21, 4096, **bf16), torch.randn(21, 4096, **bf16), torch.randn(4096, **bf16)
    total, normed = add_rmsnorm(x, delta, w, 1e-5)
    for i in range(21):
        one = add_rmsnorm(x[i : i + 1], delta[i : i + 1], w, 1e-5)
        assert torch.equal(one[0][0], total[i]) and torch.equal(one[1][0], normed[i])
    t, prefix = 21, 700
    layout = random_layout([t, 1, 5], [prefix, 300, 40], torch.Generator().manual_seed(1), block_size=64, device="cuda")
    q = torch.randn(1, 32, layout.tokens, 128, **bf16)
    slots = (1 + layout.table.numel()) * layout.block_size
    k, v = torch.randn(1, 8, slots, 128, **bf16), torch.randn(1, 8, slots, 128, **bf16)
    tree = attention_invariant(q, k, v, *layout.attention_inputs(32))
    for token in range(int(layout.cu[-1])):
        assert torch.equal(tree[:, :, token], path_alone(q, k, v, layout, token)), token
    heads = rmsnorm(q.transpose(1, 2), w[:128], 1e-6)  # [1, T, 32, 128]: the per-head norms
    assert all(torch.equal(heads[0, i], rmsnorm(q.transpose(1, 2)[0, i], w[:128], 1e-6)) for i in range(t))

    sys.path.insert(0, str(REPO / "scripts"))
    from bench_gated_delta import layer_inputs

    from specgraph.models.widen import QWEN35_REAL
    from specgraph.tree import Tree
    cpu = torch.Generator().manual_seed(2)
    for shape in QWEN35_REAL.values():
        tree = Tree.random(t, 6, cpu)
        args, steps = layer_inputs(shape, [tree], cpu, torch.device("cuda"), torch.bfloat16, 2 * t)
        args = (args[0].contiguous(), *args[1:])
        got = gated_delta_step_invariant(*args, *steps)
        deepest = int(tree.depths[0].argmax())
        for node in range(t):
            path = tree.ancestors[0, node].nonzero().flatten().tolist()  # root first
            outs, state, conv = one_token_steps(args, steps, 0, path)
            assert torch.equal(got[0, node], outs[-1]), node
            if node == deepest:
                committed, window = args[9][None].clone(), args[3][None].clone()
                gated_delta_commit_invariant(committed, window, *(x[None] for x in steps),
                                             torch.tensor([path], device="cuda"), args[10])
                assert torch.equal(committed[0, 0], state) and torch.equal(window[0, 0], conv)


@pytest.mark.parametrize("tokens", [2, 6, 16])
def test_few_token_projections_in_bf16_match_the_fp32_reference(tokens):
    """A drafter's tree levels (2 to FEW_ROWS tokens): projections on tensor-core tiles (K split at
    the 1B down shape), the gate/up projection and its SwiGLU, within bf16's rounding of the fp32
    results (the CPU tests run the tiles in the interpreter in fp32 only)."""
    from specgraph.kernels.linear import linear_reference
    from specgraph.kernels.linear.invariant import tiling
    from specgraph.kernels.linear.triton import linear
    from specgraph.kernels.swiglu import swiglu_reference
    from specgraph.kernels.swiglu.triton import swiglu

    g = torch.Generator(device="cuda").manual_seed(tokens)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    for op, reference, (n, k) in [(linear, linear_reference, (2048, 8192)), (linear, linear_reference, (3072, 2048)),
                                  (swiglu, swiglu_reference, (16384, 2048))]:
        x, weight, bias = torch.randn(1, tokens, k, **bf16), torch.randn(n, k, **bf16) / k ** 0.5, torch.randn(n, **bf16)
        got = op(x, weight, bias).float()
        expected = reference(x.float(), weight.float(), bias.float())
        assert ((got - expected).abs() <= 2e-2 * expected.abs().clamp(min=1.0)).all(), (op, n, k)
    assert tiling(2048, 8192)[2] > 1


def test_sampling_distributions_of_a_tree_step_have_each_rows_one_token_bits():
    """What sampling with lowering.row_invariant rests on: given row-invariant logits, a tree node's
    distribution (temperature, top-k, top-p, softmax over the logits of a step's nodes, at a
    128k vocabulary) has the bits of the same row's distribution in a one-token step."""
    from specgraph.recipe import SamplingSpec
    from specgraph.sampling import SamplingRows, probs_from_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    for rows in (21, 64):
        logits = (3 * torch.randn(rows, 128256, device="cuda", generator=g)).bfloat16().float()  # as the head gives them
        for spec in (SamplingSpec(temperature=0.8), SamplingSpec(temperature=0.7, top_k=50),
                     SamplingSpec(temperature=1.0, top_p=0.9), SamplingSpec(temperature=0.6, top_k=200, top_p=0.8)):
            settings = SamplingRows.of([spec], "cuda")
            whole = probs_from_logits(logits[None], settings)[0]
            assert all(torch.equal(whole[i], probs_from_logits(logits[None, i : i + 1], settings)[0, 0])
                       for i in range(rows)), spec


@pytest.mark.parametrize("target", ["target", "hybrid"])
@pytest.mark.parametrize("tree", [{"shape": "chain", "length": 4}, {"shape": "static", "branching": [3, 2, 1]},
                                  {"shape": "dynamic", "width": 3, "depth": 4, "nodes": 12}],
                         ids=["chain", "static", "dynamic"])
def test_row_invariant_speculation_in_bf16_decodes_the_autoregressive_tokens(tree, target, code_prompts):
    """bf16, lowering.row_invariant, steps captured and layers compiled, a Llama or a Qwen3.5 hybrid
    target: on 16 code prompts x 128 tokens the recipe's greedy tokens are the target's own
    one-token-at-a-time greedy tokens."""
    checkpoint = EMBEDDED / "target" if target == "target" else shared_model("hybrid")
    program = on_gpu(tree, checkpoint, dtype="bfloat16", max_new_tokens=NEW_TOKENS, lowering={"row_invariant": True})
    alone = program.autoregressive()
    for prompt in code_prompts[:HELD_OUT]:
        ids = program.encode(prompt["prompt"])
        assert program.generate(ids).output_ids == alone.generate(ids, NEW_TOKENS).output_ids, prompt["id"]


def disaggregated_on(draft_device: str, target_device: str, tree: dict, **fields) -> Program:
    recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", tree, execution="disaggregated", **fields)
    devices = [[draft_device], [target_device]]
    return Program.from_recipe(recipe.model_copy(update={"stages": [
        s.model_copy(update={"devices": d}) for s, d in zip(recipe.stages, devices)]}))


@pytest.mark.parametrize("draft_device", ["cuda:1", "cuda:0"], ids=["two-gpus-nccl", "one-gpu-two-processes"])
def test_disaggregated_decodes_the_serial_tokens(draft_device):
    """fp32: the drafter on its own GPU (trees and verdicts over NCCL) or sharing the target's in a
    process of its own (over gloo); each side's phases captured as CUDA graphs."""
    if torch.cuda.device_count() < int(draft_device[-1]) + 1:
        pytest.skip("needs two GPUs")
    tree = {"shape": "dynamic", "width": 3, "depth": 3, "nodes": 8}
    serial = on_gpu(tree, max_new_tokens=64)
    with disaggregated_on(draft_device, "cuda:0", tree, max_new_tokens=64) as program:
        assert program.graph.node("draft")["step_graphs"] and program.graph.node("target")["step_graphs"]
        for text in PROMPTS:
            ids = serial.encode(text)
            assert program.generate(ids).output_ids == serial.generate(ids).output_ids


@pytest.mark.parametrize("devices", [["cuda:1", "cuda:1", "cuda:0"], ["cuda:0", "cuda:0", "cuda:0"]],
                         ids=["two-gpus", "one-gpu-three-processes"])
def test_pipeline_decodes_the_autoregressive_tokens(devices):
    """fp32: draft -> mid -> target, each stage in a process of its own (on two GPUs, or sharing
    one), its forwards replayed from CUDA graphs; the output is the target's own autoregressive one."""
    if torch.cuda.device_count() < 2 and "cuda:1" in devices:
        pytest.skip("needs two GPUs")
    recipe = Recipe.from_yaml(REPO / "recipes" / "pipeline.yaml", [
        f"models.mid.path={shared_model('mid')}", "max_new_tokens=64", "models.target.dtype=float32",
        "models.mid.dtype=float32", "models.draft.dtype=float32",
        *(f"stages.{i}.devices=[{d}]" for i, d in enumerate(devices))])
    alone = two_stage(EMBEDDED / "target", None, max_new_tokens=64)
    alone = Program.from_recipe(alone.model_copy(update={"stages": [alone.stages[0].model_copy(update={"devices": ["cuda:0"]})]}))
    with Program.from_recipe(recipe) as program:
        assert all(program.graph.node(n)["graph_buckets"] for n in program.graph.stages())
        for text in PROMPTS:
            ids = alone.encode(text)
            assert program.generate(ids).output_ids == alone.generate(ids).output_ids


def test_row_invariant_requests_decode_the_same_tokens_alone_and_in_a_batch(code_prompts):
    """bf16, lowering.row_invariant: a request's tokens do not depend on what else is in its batch
    (each of eight prompts alone, then all eight at once, steps captured per batch size)."""
    program = on_gpu({"shape": "dynamic", "width": 3, "depth": 4, "nodes": 12}, dtype="bfloat16", max_new_tokens=64,
                     lowering={"row_invariant": True}, serving={"max_batch": 8})
    encoded = [program.encode(row["prompt"]) for row in code_prompts[:8]]
    alone = [program.generate(ids).output_ids for ids in encoded]
    together = dict(program.generate_many(encoded))
    assert [together[i].output_ids for i in range(8)] == alone


@pytest.mark.parametrize("scheme", ["w4a16", "w8a16", "fp8"])
def test_quantized_projections_on_gpu_match_their_reference_and_keep_rows_invariant(scheme):
    """At the Llama-3-8B o_proj shape in bf16: the quantized tiles within two bf16 ulps of the
    reference for 1 to MAX_ROWS rows, and a row's bits the same in any row count (qlinear_invariant)."""
    from specgraph.kernels.qlinear import qlinear_reference
    from specgraph.kernels.qlinear.invariant import qlinear_invariant
    from specgraph.kernels.qlinear.triton import MAX_ROWS, qlinear
    from specgraph.quant.quantize import quantize_linear

    torch.manual_seed(0)
    layer = quantize_linear(torch.nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16), scheme)
    args = (layer.weight, layer.scales, layer.zeros, None, layer.format, layer.group)
    x = torch.randn(MAX_ROWS[layer.format] + 36, 4096, device="cuda", dtype=torch.bfloat16)
    for rows in (1, 4, 16, 17, 64, MAX_ROWS[layer.format]):
        expected = qlinear_reference(x[:rows].float(), layer.weight, layer.scales.float(), layer.zeros, None,
                                     layer.format, layer.group)
        got = qlinear(x[:rows], *args).float()
        assert ((got - expected).abs() / expected.abs().clamp(min=1)).max() < 2e-2, rows
    alone = qlinear_invariant(x[3:4], *args)
    assert all(torch.equal(qlinear_invariant(x[:rows], *args)[3:4], alone) for rows in (5, 16, 17, 64, len(x)))
    assert torch.equal(qlinear(x, *args), qlinear_reference(x, *args))  # past the tiles: the reference's weight's bits


def test_an_int4_stage_projects_up_to_eight_rows_through_tinygemm_within_the_reference():
    """A Triton-kernel stage's int4 projections get tinygemm copies (lower.load_stage -> use_tinygemm, which checks
    the layout on this torch): 1 to 8 bf16 rows go through tinygemm within 2e-2 of the reference, 9 through qlinear."""
    from specgraph.kernels import Kernels
    from specgraph.kernels.qlinear import qlinear_reference
    from specgraph.kernels.qlinear.tinygemm import TINYGEMM_ROWS, use_tinygemm
    from specgraph.kernels.qlinear.triton import qlinear
    from specgraph.quant.quantize import quantize_linear

    torch.manual_seed(0)
    model = torch.nn.Sequential(quantize_linear(torch.nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16),
                                                "w4a16", 128))
    use_tinygemm(model)
    layer = model[0]
    assert layer.tinygemm_weight is not None and "tinygemm_weight" not in layer.state_dict()
    kernels = Kernels.select({"qlinear": "triton"})
    x = torch.randn(TINYGEMM_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16)
    args = (layer.weight, layer.scales, layer.zeros, layer.bias, layer.format, layer.group)
    for rows in (1, 2, TINYGEMM_ROWS):
        expected = qlinear_reference(x[:rows].float(), layer.weight, layer.scales.float(), layer.zeros,
                                     layer.bias.float(), "int4", 128)
        got = kernels.project(x[:rows], layer)
        assert got.dtype == torch.bfloat16 and not torch.equal(got, qlinear(x[:rows], *args)), rows  # (its own sums)
        assert ((got.float() - expected).abs() / expected.abs().clamp(min=1)).max() < 2e-2, rows
    assert torch.equal(kernels.project(x, layer), qlinear(x, *args))
    assert torch.equal(Kernels.select({"qlinear": "reference"}).project(x[:1], layer),  # (an exported program's)
                       qlinear_reference(x[:1], *args))


def test_row_invariant_speculation_over_a_quantized_target_decodes_its_autoregressive_tokens(tmp_path, code_prompts):
    """bf16, lowering.row_invariant, an int4 target (written by `specgraph quantize`): greedy tokens
    of a dynamic tree equal the quantized target's own one-token-at-a-time greedy tokens."""
    from specgraph.cli import main

    checkpoint = tmp_path / "target-w4"
    assert main(["quantize", str(EMBEDDED / "target"), "-o", str(checkpoint), "--scheme", "w4a16", "--group-size", "32"]) == 0
    program = on_gpu({"shape": "dynamic", "width": 3, "depth": 4, "nodes": 12}, checkpoint, dtype="bfloat16",
                     max_new_tokens=NEW_TOKENS, lowering={"row_invariant": True})
    alone = program.autoregressive()
    for prompt in code_prompts[:HELD_OUT]:
        ids = program.encode(prompt["prompt"])
        assert program.generate(ids).output_ids == alone.generate(ids, NEW_TOKENS).output_ids, prompt["id"]
