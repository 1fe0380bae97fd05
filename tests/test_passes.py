"""Each pass does its job, declares what it provides, and leaves its input untouched."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from conftest import EMBEDDED, shared_model
from helpers import two_stage

from specgraph.errors import CheckpointError, RecipeError
from specgraph.graph import SpecGraph
from specgraph.models.loader import load_model
from specgraph.passes import PIPELINE, run_pipeline
from specgraph.passes.capture_graphs import capture_graphs
from specgraph.passes.compile_stages import compile_stages
from specgraph.passes.place import place
from specgraph.passes.plan_memory import plan_memory
from specgraph.passes.plan_tree import plan_tree
from specgraph.passes.select_kernels import select_kernels
from specgraph.passes.validate import validate
from specgraph.recipe import DynamicTree, Recipe, apply_override
from specgraph.tree import TreeTopology

TARGET, DRAFT = EMBEDDED / "target", EMBEDDED / "draft"


def graph(draft=DRAFT, tree=None, **fields) -> SpecGraph:
    return SpecGraph.from_recipe(two_stage(TARGET, draft, tree, **fields))


def test_pipeline_order_is_the_documented_one():
    assert [p.__name__ for p in PIPELINE] == ["validate", "place", "plan_tree", "plan_memory", "compile_stages",
                                              "select_kernels", "capture_graphs"]


def test_validate_reads_configs_and_resolves_rules():
    g = validate(graph())
    target, draft = g.node("target"), g.node("draft")
    assert target["config"].architectures == ["LlamaForCausalLM"] and draft["config"].hidden_size == 192
    assert target["eos_ids"] == (0,) and target["rule"] == "greedy"
    assert target["tokenizer"] == draft["tokenizer"] is not None
    assert validate(graph(sampling={"temperature": 0.7})).node("target")["rule"] == "sampling"


def test_passes_do_not_mutate_their_input():
    g = graph()
    before = {n: dict(g.node(n)) for n in g.stages()}
    planned = run_pipeline(g)
    assert {n: dict(g.node(n)) for n in g.stages()} == before
    assert "cache_slots" in planned.node("target") and "config" not in g.node("target")


def test_place_resolves_devices_and_dtypes():
    g = place(validate(graph()))
    assert g.node("target")["device"] == torch.device("cpu")
    assert g.node("target")["dtype"] == torch.float32  # dtype given as float32
    auto = SpecGraph.from_recipe(two_stage(TARGET, None, dtype="auto"))
    assert place(validate(auto)).node("target")["dtype"] == torch.float32  # auto on the CPU


def test_plan_tree_gives_each_drafter_its_topology():
    g = plan_tree(place(validate(graph(tree={"shape": "static", "branching": [2, 2]}))))
    topo = g.node("draft")["tree"]
    assert isinstance(topo, TreeTopology) and topo.parents == (-1, 0, 0, 1, 1, 2, 2)
    assert g.node("draft")["tree_nodes"] == 6 and g.node("draft")["tree_depth"] == 2
    assert g.node("target")["tree"] is None
    default = plan_tree(place(validate(graph()))).node("draft")
    assert default["tree_nodes"] == 4 and default["tree"].parents == (-1, 0, 1, 2, 3)  # chain of 4
    dyn = plan_tree(place(validate(graph(tree={"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}))))
    assert isinstance(dyn.node("draft")["tree"], DynamicTree) and dyn.node("draft")["tree_nodes"] == 10


def test_plan_memory_sizes_caches_for_the_tree():
    g = run_pipeline(graph(tree={"shape": "chain", "length": 6}, max_seq_len=300))
    assert g.node("target")["cache_slots"] == 300 + 1 + 6  # prefix + root + verified tree
    assert g.node("draft")["cache_slots"] == 300 + 1 + 6 + 1
    assert (g.node("target")["step_tokens"], g.node("draft")["step_tokens"]) == (1 + 6, 1 + 6 + 1)
    target = g.node("target")
    # 8 layers x (k, v) x 1 kv head x 128 dims x slots x 4 bytes
    assert target["kv_bytes"] == 2 * 8 * 1 * 128 * 307 * 4
    params = sum(t.numel() for f in TARGET.glob("*.safetensors") for t in load_file(f).values())
    assert target["parameters"] == params


def test_compile_stages_follows_the_recipe_and_the_device():
    assert run_pipeline(graph()).node("target")["compile"] is False  # auto: not on the CPU
    forced = run_pipeline(graph(lowering={"compile": True}))
    assert forced.node("target")["compile"] is True and forced.node("draft")["compile"] is True
    gpu = place(validate(graph()))
    for name in gpu.stages():
        gpu.node(name)["device"] = torch.device("cuda:0")  # plan for a GPU without needing one
    assert all(compile_stages(gpu).node(name)["compile"] for name in gpu.stages())  # auto: on a GPU


def test_capture_graphs_lists_the_step_sizes_of_each_stage():
    g = run_pipeline(graph(tree={"shape": "static", "branching": [3, 2, 1]}))
    assert g.node("target")["graph_buckets"] == ()  # the CPU has no CUDA graphs
    gpu = place(validate(graph(tree={"shape": "static", "branching": [3, 2, 1]})))
    for name in gpu.stages():
        gpu.node(name)["device"] = torch.device("cuda:0")  # plan for a GPU without needing one
    gpu = capture_graphs(plan_memory(plan_tree(gpu)))
    assert gpu.node("target")["step_graphs"] and gpu.node("target")["static_shapes"]
    assert gpu.node("target")["graph_buckets"] == ()  # whole steps are captured: no per-forward graphs
    sampled = place(validate(graph(tree={"shape": "static", "branching": [3, 2, 1]}, sampling={"temperature": 0.7})))
    for name in sampled.stages():
        sampled.node(name)["device"] = torch.device("cuda:0")
    together = capture_graphs(plan_memory(plan_tree(sampled)))  # counter-based draws: a graph holds them
    assert together.node("target")["step_graphs"] and together.node("target")["graph_buckets"] == ()
    sampled.node("draft")["device"] = torch.device("cuda:1")
    sampled = capture_graphs(plan_memory(plan_tree(sampled)))  # two GPUs: forwards are captured one by one instead
    assert not sampled.node("target")["step_graphs"]
    assert sampled.node("target")["graph_buckets"] == (1, 1 + 3 + 6 + 6)
    assert sampled.node("draft")["graph_buckets"] == (2, 3, 6)  # catch-up, then 3 and 6 nodes expanded
    hybrid = place(validate(graph(draft=shared_model("hybrid"), tree={"shape": "static", "branching": [3, 2, 1]},
                                  sampling={"temperature": 0.7})))
    for name, device in zip(hybrid.stages(), ("cuda:1", "cuda:0")):
        hybrid.node(name)["device"] = torch.device(device)
    hybrid = capture_graphs(plan_memory(plan_tree(hybrid)))  # a hybrid drafter re-feeds the catch-up and all fed so far
    assert hybrid.node("draft")["graph_buckets"] == (2, 2 + 3, 2 + 3 + 6)
    dyn = place(validate(graph(tree={"shape": "dynamic", "width": 5, "depth": 3, "nodes": 20})))
    dyn.node("draft")["device"] = dyn.node("target")["device"] = torch.device("cuda:0")
    assert capture_graphs(plan_memory(plan_tree(dyn))).node("target")["step_graphs"]  # dynamic growth is on the device too
    dyn = place(validate(graph(tree={"shape": "dynamic", "width": 5, "depth": 3, "nodes": 20}, lowering={"cuda_graphs": False})))
    assert capture_graphs(plan_memory(plan_tree(dyn))).node("draft")["graph_buckets"] == ()
    dyn.node("draft")["device"] = dyn.node("target")["device"] = torch.device("cuda:0")
    off = capture_graphs(plan_memory(plan_tree(dyn)))  # turned off in the recipe
    assert off.node("draft")["graph_buckets"] == () and not off.node("draft")["static_shapes"]


def test_a_pipeline_plans_windows_how_far_ahead_and_every_forward_size():
    stages = [{"name": "a", "model": "d", "tree": {"shape": "chain", "length": 3}},
              {"name": "b", "model": "d", "verifies": "a", "verify": {"window": 5}},
              {"name": "c", "model": "t", "verifies": "b"}]
    g = place(validate(SpecGraph.from_recipe(Recipe.from_dict({
        "name": "p", "models": {"t": {"path": str(TARGET)}, "d": {"path": str(DRAFT)}}, "stages": stages,
        "execution": "pipeline", "max_seq_len": 100}))))
    for name in g.stages():
        g.node(name)["device"] = torch.device("cuda:0")
    g = capture_graphs(plan_memory(plan_tree(g)))
    a, b, c = (g.node(n) for n in "abc")
    assert (b["window"], c["window"]) == (5, 3)  # c's default: the first stage's chain
    assert (a["ahead"], b["ahead"], c["ahead"]) == (10, 6, None)  # twice the window above
    assert not any(n["step_graphs"] for n in (a, b, c))  # forward by forward
    assert a["graph_buckets"] == (1, 2, 3)  # a chain's feeds, and catch-ups of up to one token per stage
    assert b["graph_buckets"] == tuple(range(1, 1 + 5 + 1 + 1))  # root, window, one token adopted from c
    assert c["graph_buckets"] == tuple(range(1, 1 + 3 + 1))
    # Each stage's cache must hold the most tokens it may have committed before a step, and what the step
    # writes past them. c steps while its output has room (at most 99 tokens), committing up to its window
    # and its own token. A stage below steps while fewer than its `ahead` tokens are unverified above (it
    # has at most ahead - 1 more than the stage above ever had); b's step then commits up to its window
    # and its own token, a's its chain.
    c_before = 100 - 1
    b_before = (c_before + 3 + 1) + 6 - 1
    a_before = (b_before + 5 + 1) + 10 - 1
    # A step writes its root (the last committed token) and the nodes after it: c its window, b also one
    # token adopted from c, a its chain
    for node, needed in ((c, c_before + 3), (b, b_before + 1 + 5), (a, a_before + 3)):
        assert node["cache_slots"] >= needed


def test_pass_requirements_are_enforced():
    with pytest.raises(RuntimeError, match="requires"):
        plan_memory(graph())


def copy_model(src, dest, edit=None):
    shutil.copytree(src, dest)
    for f in dest.iterdir():
        f.chmod(0o644)
    if edit:
        edit(dest)
    return dest


def edit_json(name, change):
    def edit(folder):
        data = json.loads((folder / name).read_text())
        change(data)
        (folder / name).write_text(json.dumps(data))
    return edit


def test_bad_checkpoints_are_refused(tmp_path):
    cases = {
        "missing": (tmp_path / "nowhere", "models.draft.path: .*nowhere: checkpoint folder does not exist"),
        "noconfig": (copy_model(DRAFT, tmp_path / "noconfig", lambda f: (f / "config.json").unlink()), "no config.json"),
        "arch": (copy_model(DRAFT, tmp_path / "arch", edit_json("config.json", lambda c: c.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))),
                 "unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM"),
        "tokenizer": (copy_model(DRAFT, tmp_path / "tok", edit_json("tokenizer.json", lambda t: t["model"]["vocab"].update({"zz": 4095}))),
                      "models.draft: tokenizer differs from models.target's"),
        "vocab": (copy_model(DRAFT, tmp_path / "vocab", lambda f: (edit_json("config.json", lambda c: c.update(
                      vocab_size=5000))(f), (f / "tokenizer.json").unlink())),  # (with tokenizers, tests/test_vocab.py)
                  "models.draft: vocab_size 5000 differs from models.target's 4096, and without a tokenizer.json"),
    }
    for name, (folder, expected) in cases.items():
        with pytest.raises(CheckpointError, match=expected):
            run_pipeline(graph(draft=folder))
    pickle = copy_model(DRAFT, tmp_path / "pickle", lambda f: ((f / "model.safetensors").rename(f / "pytorch_model.bin")))
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights \\(found pytorch_model.bin: pickle checkpoints "
                                              "are never loaded"):
        load_model(pickle, torch.float32, "cpu")


@pytest.mark.parametrize("change, expected", [
    ({"models.draft.path": "HYBRID", "execution": "disaggregated"},
     "stages.0.model: models.draft is a hybrid model (Qwen3_5ForCausalLM), which drafts under execution: disaggregated "
     "only a static tree (tree: {shape: static}), drafted anew after each verdict"),
    ({"models.draft.path": "HYBRID", "execution": "pipeline", "models.mid": {"path": "TARGET"},
      "stages": [{"name": "draft", "model": "draft", "devices": ["cpu"]},
                 {"name": "mid", "model": "mid", "devices": ["cpu"], "verifies": "draft"},
                 {"name": "target", "model": "target", "devices": ["cpu"], "verifies": "mid"}]},
     "stages.0.model: models.draft is a hybrid model (Qwen3_5ForCausalLM), which runs in a pipeline only as the last stage"),
    ({"models.target.path": "HYBRID", "stages.0.tree": {"shape": "static", "branching": [4, 3, 3, 3]}},
     "stages.0.tree: a hybrid target verifies at most 128 tokens per step; this tree and its root are 161"),
    ({"models.draft.path": "HYBRID", "models.target.path": "HYBRID", "stages.0.tree": {"shape": "static", "branching": [4, 3, 3, 3]}},
     "stages.0.tree: a hybrid drafter feeds at most 128 tokens per step; this tree and its catch-up are 162"),
])
def test_where_a_hybrid_model_may_run(change, expected):
    data = two_stage(TARGET, DRAFT).model_dump(mode="json")
    paths = {'"HYBRID"': json.dumps(str(shared_model("hybrid"))), '"TARGET"': json.dumps(str(TARGET))}
    for key, value in change.items():
        text = json.dumps(value)
        for name, path in paths.items():
            text = text.replace(name, path)
        apply_override(data, f"{key}={text}")
    with pytest.raises(RecipeError) as info:
        run_pipeline(SpecGraph.from_recipe(Recipe.from_dict(data)))
    assert expected in str(info.value)


@pytest.mark.parametrize("change, expected", [
    ({"execution": "pipeline", "stages.0.tree": {"shape": "dynamic", "width": 2, "depth": 2, "nodes": 4},
      "stages.1.verify": {"window": 2}}, "stages.1.verify.window: the stage above a first stage that drafts a tree"),
    ({"sampling": {"temperature": 0.5}, "stages.1.verify": {"rule": "greedy"}}, "stages.1.verify.rule: 'greedy' needs sampling.temperature 0"),
    ({"stages.1.verify": {"rule": "sampling"}}, "stages.1.verify.rule: 'sampling' needs sampling.temperature > 0"),
    ({"stages.0.devices": ["tpu:0"]}, "stages.0.devices.0: 'tpu:0' is not a device; valid: cpu, cuda:N, auto"),
    ({"stages.1.devices": ["cuda:7"]}, "stages.1.devices.0: device cuda:7 is not present; this machine has: cpu"),
    ({"stages.0.devices": ["cpu", "cpu"], "stages.1.devices": ["cpu", "cpu", "cpu"]},
     "tensor-parallel stages must list the same number of devices (stages.0: 2, stages.1: 3)"),
    ({"stages.1.tree": {"shape": "chain", "length": 2}}, "stages.1.tree: the last stage drafts for no one"),
    ({"stages.0.tree": {"shape": "dynamic", "width": 2, "depth": 2, "nodes": 7}}, "stages.0.tree.nodes: 7 exceeds the 6 nodes"),
    ({"max_seq_len": 5000}, "max_seq_len: 5000 exceeds models.draft's max_position_embeddings 4096"),
    ({"lowering.row_invariant": True, "stages.1.devices": ["cpu", "cpu", "cpu"], "stages.0.devices": ["cpu", "cpu", "cpu"]},
     "lowering.row_invariant: stages.1.devices: a sum over more than two tensor-parallel ranks depends on their order; "
     "give the target one or two devices"),
])
def test_impossible_plans_are_refused(change, expected):
    data = two_stage(TARGET, DRAFT).model_dump(mode="json")
    for key, value in change.items():
        apply_override(data, f"{key}={json.dumps(value)}")
    with pytest.raises((RecipeError, CheckpointError)) as info:
        run_pipeline(SpecGraph.from_recipe(Recipe.from_dict(data)))
    assert expected in str(info.value)


def test_three_stage_hierarchy_needs_the_pipeline_executor():
    recipe = Recipe.from_dict({"name": "h", "models": {"t": {"path": str(TARGET)}, "d": {"path": str(DRAFT)}},
                               "stages": [{"name": "a", "model": "d"}, {"name": "b", "model": "d", "verifies": "a"},
                                          {"name": "c", "model": "t", "verifies": "b"}]})
    with pytest.raises(RecipeError, match="3 stages form a hierarchy, which needs execution: pipeline"):
        run_pipeline(SpecGraph.from_recipe(recipe))


def test_select_kernels_picks_triton_where_it_pays():
    cpu = run_pipeline(graph())
    assert set(cpu.node("target")["kernels"].values()) == {"reference"}

    def on_gpu(**lowering) -> dict[str, str]:
        placed = place(validate(graph(lowering=lowering)))
        for name in placed.stages():
            placed.node(name)["device"] = torch.device("cuda:0")
        return select_kernels(placed).node("target")["kernels"]

    auto = on_gpu()
    assert auto.pop("gated_delta_step") == auto.pop("gated_delta_commit") == "invariant"  # the walk
    assert set(auto.values()) == {"triton"}
    for named in ("gated_delta_step", "gated_delta_commit"):  # naming one of the pair names both
        for kind in ("triton", "reference"):
            chosen = on_gpu(kernels={named: kind})
            assert chosen["gated_delta_step"] == chosen["gated_delta_commit"] == kind
    mixed = on_gpu(kernels={"gated_delta_step": "triton", "gated_delta_commit": "reference"})  # both closed forms
    assert (mixed["gated_delta_step"], mixed["gated_delta_commit"]) == ("triton", "reference")
    assert on_gpu(row_invariant=True)["gated_delta_commit"] == "invariant"
    reference = run_pipeline(graph(lowering={"kernels": "reference"}))
    assert set(reference.node("target")["kernels"].values()) == {"reference"}
    forced = run_pipeline(graph(lowering={"kernels": "triton"}))
    assert set(forced.node("draft")["kernels"].values()) == {"triton"}
    invariant = run_pipeline(graph(lowering={"row_invariant": True}))  # the target's row-invariant kernels, on any device
    assert invariant.node("target")["kernels"] == {**cpu.node("target")["kernels"], "linear": "invariant",
                                                   "qlinear": "invariant", "swiglu": "invariant", "attention": "invariant",
                                                   "gated_delta_step": "invariant", "gated_delta_commit": "invariant",
                                                   "add_rmsnorm": "triton", "rmsnorm": "triton", "rope_write": "triton"}
    assert invariant.node("draft")["kernels"] == cpu.node("draft")["kernels"]


def test_an_exported_programs_caches_commit_in_closed_form_like_its_traced_step():
    """A package's gated-DeltaNet step is the traced reference (closed form): where the plan would
    give its cache the walk's commit (auto on a GPU), load_program gives the closed form's."""
    from specgraph.export import closed_form_commits

    placed = place(validate(graph()))
    for name in placed.stages():
        placed.node(name)["device"] = torch.device("cuda:0")
    kernels = closed_form_commits(select_kernels(placed)).node("target")["kernels"]
    assert kernels["gated_delta_step"] == kernels["gated_delta_commit"] == "triton"
    assert set(closed_form_commits(run_pipeline(graph())).node("target")["kernels"].values()) == {"reference"}  # CPU


def test_triton_kernels_on_the_cpu_outside_the_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RecipeError, match=r"lowering.row_invariant: stage 1 \(target\) is on the CPU, where Triton "
                                          "kernels run only under TRITON_INTERPRET=1"):
        run_pipeline(graph(lowering={"row_invariant": True}))
    with pytest.raises(RecipeError, match=r"lowering.kernels: stage 0 \(draft\) is on the CPU"):
        run_pipeline(graph(lowering={"kernels": {"attention": "triton"}}))
