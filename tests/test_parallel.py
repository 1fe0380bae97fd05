"""Tensor parallelism on the CPU (gloo): `specgraph run` and `bench` start one process per device,
and stages split over two ranks decode the single-device tokens.

Most tests widen draft and target (same function) to 6 query heads over 2 KV heads, which split
evenly; the fixtures themselves (3 query heads over 1 KV head) split unevenly over two and three."""

import json
import socket
import time
from dataclasses import replace

import pytest
import torch
from conftest import EMBEDDED, shared_model
from helpers import PROMPT, save_checkpoint, splittable_recipe, two_stage

from specgraph.models.widen import widen
from specgraph.cli import main
from specgraph.errors import RecipeError, SpecgraphError
from specgraph.models.loader import load_model
from specgraph.parallel import split_heads
from specgraph.program import Program
from specgraph.recipe import Recipe
from specgraph.runtime.ranks import Ranks


@pytest.fixture(scope="module")
def splittable(tmp_path_factory):
    return splittable_recipe(tmp_path_factory.mktemp("tp"))


def test_a_target_split_over_two_processes_decodes_the_single_device_tokens(splittable, tmp_path):
    """Under the adaptive policy, whose ranks must choose each step's mode alike (on agreed times)."""
    single = Program.from_recipe(Recipe.from_yaml(splittable))
    expected = single.generate(single.encode(PROMPT))
    fixture = Program.from_recipe(Recipe.from_yaml(splittable, [f"models.target.path={EMBEDDED / 'target'}"]))
    assert expected.output_ids == fixture.generate(fixture.encode(PROMPT)).output_ids  # widening kept the function
    out = tmp_path / "tp.json"
    status = main(["run", str(splittable), "--set", "stages.0.devices=[cpu,cpu]", "--set", "stages.1.devices=[cpu,cpu]",
                   "--prompt", PROMPT, "--json", str(out)])
    assert status == 0
    result = json.loads(out.read_text())["results"][0]
    assert result["output_ids"] == expected.output_ids  # (the steps are the policy's: each program times its own)


def test_bench_runs_split_and_says_why_transformers_cannot(splittable, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": PROMPT}) + "\n")
    out = tmp_path / "bench.json"
    status = main(["bench", str(splittable), "--set", "stages.1.devices=[cpu,cpu]", "--prompts", str(prompts),
                   "--max-new-tokens", "16", "--repeats", "1", "--baselines", "hf,ar", "--json", str(out)])
    assert status == 0
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"specgraph", "ar"}
    assert "tensor-parallel over 2" in report["skipped"]["hf"]
    assert report["systems"]["specgraph"]["same_tokens_as_ar"] == 1.0


def test_a_split_program_from_python_starts_its_processes_and_close_stops_them(splittable):
    import os

    single = Program.from_recipe(Recipe.from_yaml(splittable))
    expected = single.generate(single.encode(PROMPT), 12).output_ids
    with Program.from_recipe(Recipe.from_yaml(splittable, ["stages.1.devices=[cpu,cpu]"])) as split:
        assert not split.stages and len(split.cluster.pids) == 2  # the stages live in the ranks
        assert split.generate(split.encode(PROMPT), 12).output_ids == expected
    for pid in split.cluster.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(SpecgraphError, match="processes were stopped"):
        split.generate(split.encode(PROMPT), 4)


@pytest.mark.parametrize("model", ["target", "hybrid"])
def test_widening_builds_each_ranks_shard_directly(model):
    """`widen(..., shard=)` (layer by layer, for models no device holds whole) equals widening then sharding."""
    from specgraph.parallel import shard_model

    path = EMBEDDED / "target" if model == "target" else shared_model("hybrid")
    small = load_model(path, torch.float32, "cpu")
    if model == "target":
        shape = replace(small.shape, num_heads=6, num_kv_heads=2, num_layers=small.shape.num_layers + 1)
    else:  # one more DeltaNet + attention group; the one KV head replicated
        shape = replace(small.shape, layer_types=small.shape.layer_types + small.shape.layer_types[-4:],
                        linear_value_heads=8)
    for rank in range(2):
        direct = widen(small, shape, "cpu", torch.float32, tied=True, shard=(rank, 2, None))
        after = shard_model(widen(small, shape, "cpu", torch.float32, tied=True), rank, 2, None)
        assert direct.shape == after.shape and direct.shape.num_kv_heads == 1
        for (name, a), (_, b) in zip(direct.state_dict().items(), after.state_dict().items()):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("heads, key_heads, value_heads, world, tokens", [(2, 4, 8, 2, 24), (3, 3, 6, 3, 16)],
                         ids=["even-over-2", "uneven-over-3"])
def test_a_hybrid_target_split_over_processes_decodes_the_tokens_of_transformers(hybrid_reference, tmp_path, heads,
                                                                                 key_heads, value_heads, world, tokens):
    """The Qwen3.5 fixture, widened (same function) to `heads` attention heads and `key_heads` DeltaNet
    key heads over `value_heads` value heads, over `world` ranks. Over 2: an attention head each (the
    one KV head replicated), two key heads each, each read by two of its value heads, half the MLP.
    Over 3: an attention head each, a key head each with its two value heads, 342 + 341 + 341 MLP units."""
    small = load_model(shared_model("hybrid"), torch.float32, "cpu")
    wide = widen(small, replace(small.shape, num_heads=heads, linear_key_heads=key_heads,
                                linear_value_heads=value_heads), "cpu", torch.float32, tied=True)
    hybrid = save_checkpoint(wide, shared_model("hybrid"), tmp_path / "hybrid", num_attention_heads=heads,
                             linear_num_key_heads=key_heads, linear_num_value_heads=value_heads)
    recipe = two_stage(hybrid, EMBEDDED / "draft", {"shape": "static", "branching": [3, 2, 1]}, max_new_tokens=tokens)
    ids, expected = hybrid_reference[0]
    with Program.from_recipe(Recipe.from_dict(recipe.model_dump(mode="json") | {"stages": [
            recipe.stages[0].model_dump(mode="json"),
            recipe.stages[1].model_dump(mode="json") | {"devices": ["cpu"] * world}]})) as split:
        assert len(split.cluster.pids) == world
        generation = split.generate(ids)
    assert generation.output_ids == expected[:tokens] and max(generation.accepted_lengths) > 1


@pytest.mark.parametrize("world", [2, 3])
def test_stages_split_unevenly_decode_the_single_device_tokens(world, tmp_path):
    """The demo's fixtures (3 query heads reading 1 KV head; MLPs of 512 and 1024 units) over 2 ranks
    (2 + 1 heads, the KV head on both) and over 3 (a head each; 342 + 341 + 341 units)."""
    demo = EMBEDDED.parent / "demo.yaml"
    always = "serving.speculation=always"  # (the adaptive policy's steps follow each program's measured times)
    single = Program.from_recipe(Recipe.from_yaml(demo, [always]))
    expected = single.generate(single.encode(PROMPT), 32)
    devices = "[" + ",".join(["cpu"] * world) + "]"
    out = tmp_path / "tp.json"
    assert main(["run", str(demo), "--set", f"stages.0.devices={devices}", "--set", f"stages.1.devices={devices}",
                 "--set", always, "--prompt", PROMPT, "--max-new-tokens", "32", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert result["output_ids"] == expected.output_ids and result["accepted_lengths"] == expected.accepted_lengths


@pytest.mark.parametrize("heads, kv_heads", [(3, 1), (8, 8), (64, 8), (6, 2), (12, 3), (40, 8), (2, 1), (32, 16)])
def test_every_query_head_is_on_exactly_one_rank_with_the_kv_head_it_reads(heads, kv_heads):
    group = heads // kv_heads
    for world in range(1, 9):
        try:
            splits = [split_heads(heads, kv_heads, world, rank) for rank in range(world)]
        except RecipeError as exc:
            assert world > heads and "give some of" in str(exc)
            continue
        owners = [r for r, s in enumerate(splits) for _ in range(s.q)]
        assert len(owners) == heads and [s.q0 for s in splits] == [owners.index(r) for r in range(world)]
        for s in splits:
            assert all(s.kv0 <= i // group < s.kv0 + s.kv for i in range(s.q0, s.q0 + s.q))  # the heads it reads
            assert s.q == s.kv * group or s.kv == 1  # whole groups, or part of one replicated KV head
        assert max(s.q for s in splits) - min(s.q for s in splits) <= group  # as even as whole groups allow


@pytest.mark.parametrize("heads, kv_heads, world", [(8, 4, 3), (64, 8, 6), (10, 5, 3), (3, 1, 2), (6, 2, 5)])
def test_the_ranks_shards_of_a_layer_sum_to_the_whole_layer(heads, kv_heads, world):
    """float64, random weights with a qkv bias and per-head norms: each rank's attention and MLP
    (before the all-reduce) over a 5-node tree, summed over the ranks, give the unsplit layer's."""
    import copy

    from specgraph.layout import Layout
    from specgraph.models.llama import DecoderLayer, LlamaShape
    from specgraph.parallel import shard_layer, sharded_shape

    torch.manual_seed(0)
    shape = LlamaShape(vocab_size=8, hidden_size=32, intermediate_size=37, num_layers=1, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=8, rms_norm_eps=1e-6, qkv_bias=True, qk_norm=True)
    layer = DecoderLayer(shape).double()
    for p in layer.parameters():
        p.data.normal_()
    x = torch.randn(1, 5, 32, dtype=torch.float64)  # [B, T, hidden]
    cos, sin = torch.randn(2, 1, 1, 5, 8, dtype=torch.float64)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    layout = Layout.single(torch.zeros(1, 1, dtype=torch.long), 16, torch.tensor(0), torch.arange(5), tree,
                           torch.arange(5), 16)  # one request in one block of 16 slots

    def outputs(part: DecoderLayer, kv: int) -> torch.Tensor:
        keys, values = (torch.zeros(1, kv, 16, 8, dtype=torch.float64) for _ in range(2))  # [1, Hkv, S, K]
        with torch.no_grad():
            return torch.cat([part.self_attn(x, cos, sin, keys, values, layout.slots,
                                              layout.attention_inputs(part.self_attn.num_heads)),
                              part.mlp(x)])

    whole, total = outputs(layer, kv_heads), 0
    for rank in range(world):
        part = copy.deepcopy(layer)
        shard_layer(part, shape, rank, world, None)
        part.self_attn.reduce = part.mlp.reduce = lambda y: y
        total = total + outputs(part, sharded_shape(shape, world, rank).num_kv_heads)
    assert torch.allclose(total, whole, rtol=1e-10, atol=1e-10)


def test_a_split_that_leaves_a_device_no_head_is_a_one_line_error(capfd):
    demo = EMBEDDED.parent / "demo.yaml"
    assert main(["run", str(demo), "--set", "stages.1.devices=[cpu,cpu,cpu,cpu]", "--set",
                 "stages.0.devices=[cpu,cpu,cpu,cpu]", "--max-new-tokens", "4"]) == 2
    err = capfd.readouterr().err
    assert "specgraph: error: stage draft: num_heads 3 over 1 KV heads give some of 4 devices no head; use at most 3 " \
           "devices" in err
    assert "Traceback" not in err


def test_split_stages_are_not_exported(capsys, tmp_path):
    demo = EMBEDDED.parent / "demo.yaml"
    assert main(["compile", str(demo), "-o", str(tmp_path), "--set", "stages.1.devices=[cpu,cpu]"]) == 2
    assert "compile: stages split over 2 devices cannot be exported yet" in capsys.readouterr().err


def test_a_gpu_shared_by_the_ranks_is_refused(splittable, monkeypatch):
    """Every rank runs a one-device stage; beside stages split over GPUs it would run twice on one GPU."""
    import sys

    from specgraph.passes import plan

    monkeypatch.setattr(sys.modules["specgraph.passes.place"], "present_devices", lambda: ["cpu", "cuda:0", "cuda:1"])
    recipe = Recipe.from_yaml(splittable, ["stages.0.devices=[cuda:0]", "stages.1.devices=[cuda:0,cuda:1]"])
    with pytest.raises(SpecgraphError, match=r"^stages.0.devices: cuda:0 would be shared by the 2 processes of the "
                                             r"tensor-parallel stages; list their 2 devices here too$"):
        plan(recipe)


@pytest.mark.parametrize("draft, target, process", [
    ("[cpu]", "[cuda:0,cuda:1]", "process 0 would run stages.0 on cpu, stages.1 on cuda:0"),
    ("[cuda:1]", "[cuda:0]", "process 0 would run stages.0 on cuda:1, stages.1 on cuda:0"),
    ("[cuda:0,cuda:1]", "[cuda:1,cuda:0]", "process 0 would run stages.0 on cuda:0, stages.1 on cuda:1"),
])
def test_a_serial_process_on_two_devices_is_refused(splittable, monkeypatch, draft, target, process):
    """Serial execution runs every stage in each process on that process's one device (the engine's
    batch lives there): a drafter on the CPU beside a target on GPUs, or on another GPU, is refused
    in one line; split over the same GPUs in the same order, it plans."""
    import sys

    from specgraph.passes import plan

    monkeypatch.setattr(sys.modules["specgraph.passes.place"], "present_devices", lambda: ["cpu", "cuda:0", "cuda:1"])
    recipe = Recipe.from_yaml(splittable, [f"stages.0.devices={draft}", f"stages.1.devices={target}"])
    with pytest.raises(SpecgraphError, match=rf"^stages.\*.devices: serial execution runs a process's stages on one "
                                             rf"device \(the engine keeps its batch there\), but {process}; "):
        plan(recipe)
    same = Recipe.from_yaml(splittable, ["stages.0.devices=[cuda:0,cuda:1]", "stages.1.devices=[cuda:0,cuda:1]"])
    assert {plan(same).node(name)["device"].type for name in ("draft", "target")} == {"cuda"}


def _agree_on_times(rank: int, port: int, results) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        ranks = Ranks(rank, 2, groups={"target": torch.distributed.group.WORLD}, stage_ranks={"target": (0, 1)})
        results.put((rank, ranks.slowest("target", torch.device("cpu"))((1.0 + rank, 5.0 - rank, 0.25))))
    finally:
        torch.distributed.destroy_process_group()


def test_the_ranks_of_an_engine_take_the_slowest_rank_s_times():
    """A split engine's policy and budget decide on step times: each rank measures its own, and
    every rank must take the same decision (or their collectives part: run 2-rank TP with the
    Triton interpreter's slow, uneven steps). Each rank gets each time's largest over both ranks."""
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = torch.multiprocessing.start_processes(_agree_on_times, (port, results), nprocs=2, join=False,
                                                      start_method="spawn")
    try:
        got = dict(results.get(timeout=120) for _ in range(2))
        deadline = time.monotonic() + 60
        while not processes.join(timeout=5):  # (True once every process has ended)
            assert time.monotonic() < deadline, "the ranks did not end"
    finally:
        for process in processes.processes:
            process.kill()
    assert got == {0: (2.0, 5.0, 0.25), 1: (2.0, 5.0, 0.25)}
    alone = Ranks(stage_ranks={"target": (0,)})
    assert alone.slowest("target", torch.device("cpu"))((1.5, 0.5)) == (1.5, 0.5)
