"""The pipeline executor (PipeSpec): k stages in processes of their own, all running at once,
messages between them over torch.distributed (gloo). Its greedy output equals transformers'
greedy output of the last stage on the fixtures (16 held-out prompts x 128 new tokens) for 2-,
3- and 4-stage pipelines, asynchronous and synchronous, with a hybrid last stage; mismatches
forced at every stage leave it exact; its sampled output follows the last stage's distribution;
faults end the run in one line with no process left. (Rollback's cache invariant:
tests/test_kv_invariant.py.)"""

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import EMBEDDED, REPO, shared_model
from helpers import (ORACLE_TOKENS, PROMPT, Alone, fault_ends_the_run, hf_greedy, splittable_recipe)
from safetensors.torch import load_file, save_file

from specgraph.bench.pipespec import stage_table, steady_state
from specgraph.errors import RecipeError
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.recipe import Recipe


def checkpoint(name: str | Path) -> Path:
    if isinstance(name, Path):
        return name
    return EMBEDDED / name if name in ("draft", "target") else shared_model(name)


def pipeline(models: list, chain: int = 3, synchronous: bool = False, tree: dict | None = None, **fields) -> Recipe:
    """Stage i runs models[i] on the CPU, each verifying the one before; stage 0 drafts chains (or `tree`)."""
    stages = [{"name": f"s{i}", "model": f"m{i}", "devices": ["cpu"]} for i in range(len(models))]
    stages[0]["tree"] = tree or {"shape": "chain", "length": chain}
    for i in range(1, len(models)):
        stages[i]["verifies"] = f"s{i - 1}"
    return Recipe.from_dict({"name": "test", "models": {f"m{i}": {"path": str(checkpoint(m)), "dtype": "float32"}
                                                          for i, m in enumerate(models)},
                             "stages": stages, "execution": "pipeline",
                             "pipeline": {"synchronous": synchronous}, **fields})


DYNAMIC = {"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}
PIPELINES = {
    "2-stage": (["draft", "target"], False, None),
    # (no asynchronous draft -> mid -> target chain of its own: hybrid-last is that chain over another last stage,
    # 3-stage-tree-first those models with a tree first, 3-stage-synchronous those models and chain in lockstep)
    "3-stage-synchronous": (["draft", "mid", "target"], True, None),  # (4 prompts: the ablation's mode, same code)
    "3-stage-tree-first": (["draft", "mid", "target"], False, DYNAMIC),
    "hybrid-last": (["draft", "mid", "hybrid"], False, None),
    "4-stage": (["draft", "mid", "mid", "target"], False, None),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_greedy_output_equals_the_last_stage_alone(name, request):
    models, synchronous, tree = PIPELINES[name]
    reference = request.getfixturevalue("hybrid_reference" if models[-1] == "hybrid" else "target_reference")
    reference = reference[:4] if synchronous else reference
    accepted, stats = [], {}
    with Program.from_recipe(pipeline(models, synchronous=synchronous, tree=tree, max_new_tokens=128)) as program:
        assert len(program.cluster.pids) == len(models)
        for ids, expected in reference:
            generation = program.generate(ids)
            assert generation.output_ids == expected
            accepted += generation.accepted_lengths
            stats = {key: stats.get(key, 0) + value for key, value in generation.stats.items()}
    assert sum(accepted) / len(accepted) > 1.3  # the windows are really being accepted
    table = stage_table(stats)["stages"]
    assert list(table) == [f"s{i}" for i in range(len(models))]
    assert table["s0"]["proposed"] > 0 and table["s0"]["rolled_back"] > 0  # the drafter was rolled back
    last = table[f"s{len(models) - 1}"]
    assert last["verified"] >= last["accepted"] > 0 and last["rolled_back"] == 0  # nothing rolls the last stage back


def test_a_row_invariant_last_stage_decodes_the_last_stage_alone():
    """lowering.row_invariant: the last stage verifies windows with the invariant kernels
    (interpreted; a short prompt): transformers' greedy tokens of the last stage."""
    [(ids, expected)] = hf_greedy(EMBEDDED / "target", [{"prompt": PROMPT}], ORACLE_TOKENS)
    recipe = pipeline(["draft", "target"], max_new_tokens=ORACLE_TOKENS,
                      lowering={"kernels": "reference", "row_invariant": True})
    with Program.from_recipe(recipe) as program:
        assert program.generate(ids).output_ids == expected


def test_tensor_parallel_stages_follow_their_leaders(tmp_path, target_reference):
    """Both stages split over two processes each (gloo all-reduces in each stage's group): each
    leader's decisions reach its other rank by broadcast. The fixtures' heads do not split in two,
    so both are widened (same function) to 6 query heads over 2 KV heads: the output is still
    transformers' greedy output of the target fixture."""
    recipe = Recipe.from_yaml(splittable_recipe(tmp_path), ["execution=pipeline", "stages.0.devices=[cpu,cpu]",
                                                            "stages.1.devices=[cpu,cpu]", "max_new_tokens=128"])
    with Program.from_recipe(recipe) as program:
        assert len(program.cluster.pids) == 4
        for ids, expected in target_reference[:4]:
            generation = program.generate(ids)
            assert generation.output_ids == expected
    assert set(generation.stats) >= {"draft.steps", "target.steps"} and generation.stats["target.accepted"] > 0


def scrambled(name: str, folder: Path, seed: int) -> Path:
    """The embedded fixture `name` with its matrices replaced by random ones of the same scale: a
    model that shares the vocabulary and disagrees with everyone."""
    source, target = EMBEDDED / name, folder / f"{name}-scrambled-{seed}"
    target.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (target / file.name).write_bytes(file.read_bytes())
    generator = torch.Generator().manual_seed(seed)
    weights = {key: torch.randn(value.shape, generator=generator) * value.float().std() if value.dim() > 1 else value
               for key, value in load_file(source / "model.safetensors").items()}
    save_file({key: value.contiguous() for key, value in weights.items()}, target / "model.safetensors")
    return target


def test_mismatches_forced_at_every_stage_leave_the_output_exact(tmp_path, target_reference):
    """noise -> draft -> noise -> target: every stage rejects most of what it is sent and rolls back
    every stage below it, yet the output is the target's own."""
    noise0, noise2 = scrambled("draft", tmp_path, 1), scrambled("draft", tmp_path, 2)
    stats = {}
    with Program.from_recipe(pipeline([noise0, "draft", noise2, "target"], max_new_tokens=64)) as program:
        for ids, expected in target_reference[:4]:
            generation = program.generate(ids)
            assert generation.output_ids == expected[:64]
            stats = {key: stats.get(key, 0) + value for key, value in generation.stats.items()}
    table = stage_table(stats)["stages"]
    for i in (1, 2, 3):  # every stage above the first rejected tokens, and so rolled back all below it
        assert stats[f"s{i}.rejections"] > 0, table
    for i in (0, 1, 2):
        assert table[f"s{i}"]["rolled_back"] > 0, table


@pytest.mark.parametrize("tree", [{"shape": "chain", "length": 2}, {"shape": "static", "branching": [2, 2]}],
                         ids=["chain", "static-tree"])
def test_sampling_through_a_three_stage_pipeline_draws_the_last_stage_alone_tokens(tree):
    """Two sampled tokens after a prompt over 100 seeds (temperature 1, top-k 3): each seed's are the
    last stage alone's in transformers (helpers.Alone), whatever the mid stage accepted, so they
    follow its law (tests/test_seeded.py checks that law over seeds), not the stages' below it."""
    sampling = {"temperature": 1.0, "top_k": 3}
    alone = Alone(EMBEDDED / "target")
    with Program.from_recipe(pipeline(["draft", "mid", "target"], tree=tree, sampling=sampling, max_new_tokens=2,
                                      max_seq_len=128)) as program:
        ids = program.encode("import os\nimport sys\n\n\ndef main(")
        drawn = [program.generate(ids, seed=seed).output_ids for seed in range(100)]
    assert drawn == [alone.sample(ids, 2, seed, **sampling) for seed in range(100)]
    assert len(set(map(tuple, drawn))) > 3  # (seeds draw different tokens)


def test_killing_a_stage_ends_the_run_with_one_line_and_no_process_left():
    program = Program.from_recipe(pipeline(["draft", "mid", "target"], max_new_tokens=2000, max_seq_len=2048))
    # ranks: 0 the last stage, 1 the mid, 2 the first
    fault_ends_the_run(program, program.cluster.pids[1], signal.SIGKILL, r"^stage s1 rank 1 was killed by signal 9 \(SIGKILL\)$")


def test_a_stage_that_stops_answering_ends_the_run_within_the_timeout():
    """SIGSTOP on the first stage: a stage beside it names the stage it waited for (to send or to receive)."""
    program = Program.from_recipe(pipeline(["draft", "mid", "target"], max_new_tokens=2000, max_seq_len=2048,
                                           timeout=2.0))
    fault_ends_the_run(program, program.cluster.pids[2], signal.SIGSTOP,
                       r"^stage s[12] rank [01]: (waiting for a message from|sending to) stage .* for more than 2 s")


def test_bench_reports_each_stage_and_pipespecs_model_beside_the_measurement(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os\\nimport sys\\n"}\n{"prompt": "class Node:\\n    def __init__(self"}\n')
    out, run_out = tmp_path / "bench.json", tmp_path / "run.json"
    from specgraph.cli import main

    recipe = str(REPO / "recipes" / "pipeline.yaml")
    assert main(["bench", recipe, "--prompts", str(prompts), "--max-new-tokens", "24", "--repeats", "1",
                 "--baselines", "ar,serial", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"specgraph", "serial", "ar"}
    assert all(r["same_tokens_as_ar"] == 1.0 for r in report["systems"].values())  # fp32 on the CPU: all exact
    mine = report["systems"]["specgraph"]
    stages = mine["pipeline"]["stages"]
    assert list(stages) == ["draft", "mid", "target"]
    assert stages["target"]["steps"] == len(mine["accepted_lengths"])  # the output grows at the last stage's steps
    analytic = mine["pipeline"]["analytic"]
    assert analytic["window"] == 4 and 1 <= analytic["tokens_per_step"] <= 5 and analytic["tokens_per_second"] > 0
    assert main(["run", recipe, "--prompts", str(prompts), "--max-new-tokens", "16", "--json", str(run_out)]) == 0
    run = json.loads(run_out.read_text())
    assert all(set(r["stats"]) >= {"draft.steps", "mid.steps", "target.steps"} for r in run["results"])
    assert run["summary"]["pipeline"]["stages"]["draft"]["proposed"] > 0


def test_pipespecs_steady_state_by_hand():
    """alpha 0.5, window 2: rho = 0.5 / (1 - 0.125 + 0.5) = 4/11; E = 7/11 + (4/11) 1.75 = 14/11."""
    rho, per_step = steady_state(0.5, 2)
    assert rho == pytest.approx(4 / 11) and per_step == pytest.approx(14 / 11)
    assert steady_state(1.0, 4) == (1.0, 5.0)


@pytest.mark.parametrize("change, message", [
    ({"stages": [{"name": "s0", "model": "m0", "devices": ["cpu"]}]},
     "stages: execution: pipeline needs at least two stages"),
    ({"stages.0.tree": {"shape": "static", "branching": [2, 2]}, "stages.1.verify": {"window": 2}},
     "stages.1.verify.window: the stage above a first stage that drafts a tree verifies the whole tree"),
    ({"stages.1.tree": {"shape": "chain", "length": 2}}, "stages.1.tree: in a pipeline only the first stage drafts"),
    ({"stages.0.verify": {"window": 2}}, "stages.0.verify.window: the first stage verifies nothing"),
    ({"execution": "serial"}, "stages: 3 stages form a hierarchy, which needs execution: pipeline"),
])
def test_pipeline_recipes_that_cannot_run_are_refused_in_one_line(change, message):
    data = pipeline(["draft", "draft", "target"]).model_dump(mode="json")
    for key, value in change.items():
        if key.startswith("stages."):
            _, index, field = key.split(".")
            data["stages"][int(index)][field] = value
        else:
            data[key] = value
    with pytest.raises(RecipeError, match=f"^{message}"):
        plan(Recipe.from_dict(data))


def test_windows_are_verified_only_in_a_pipeline():
    data = pipeline(["draft", "target"]).model_dump(mode="json") | {"execution": "serial"}
    data["stages"][1]["verify"]["window"] = 3
    with pytest.raises(RecipeError, match=r"^stages.1.verify.window: windows are verified only with execution: pipeline"):
        plan(Recipe.from_dict(data))
