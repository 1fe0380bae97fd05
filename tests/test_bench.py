"""specgraph bench at small scale on the CPU, and widening to real shapes."""

import json
import sys

import pytest
import torch
from conftest import EMBEDDED, REPO, shared_model
from helpers import REDUCED, chain_logits, hf_greedy, two_stage

from specgraph.bench.systems import HFSystem, SpecgraphSystem, hf_mirror
from specgraph.models.widen import SHAPES, draft_shape_for, widen, widened_shape
from specgraph.cli import main
from specgraph.errors import SpecgraphError
from specgraph.models.hybrid import FULL, LINEAR, HybridShape
from specgraph.models.llama import LlamaShape
from specgraph.models.loader import load_model, read_config
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.graph import SpecGraph
from specgraph.recipe import DynamicTree, Recipe


def recorded(monkeypatch) -> tuple[dict[str, list], list[float]]:
    """What a bench measures, noted as it measures it: each system's runs ({name: [(prompt length,
    Run)]}, warm-up first) and the copy timings behind its bandwidth (seconds per copy)."""
    import specgraph.bench.harness as harness

    runs, copies = {}, []
    for system in (SpecgraphSystem, HFSystem):
        def run(self, ids, max_new_tokens, measure=system.run):
            result = measure(self, ids, max_new_tokens)
            runs.setdefault(self.name, []).append((len(ids), result))
            return result
        monkeypatch.setattr(system, "run", run)
    best_seconds = harness.best_seconds
    monkeypatch.setattr(harness, "best_seconds", lambda *a, **k: copies.append(best_seconds(*a, **k)) or copies[-1])
    return runs, copies


def decode_rate(runs: list) -> float:
    """Tokens after each run's first step over the seconds after it, summed over the runs."""
    tokens = sum(len(run.output_ids) - (run.accepted_lengths or [1])[0] for _, run in runs)
    return tokens / sum(run.seconds - run.first_token_seconds for _, run in runs)


def test_bench_reports_what_its_measured_times_give(tmp_path, capsys, monkeypatch):
    """Every figure of the report, by hand from the runs and copy timings the bench measured (two
    prompts, an untimed pass over both, two timed repeats): rates, ratios, steps, the bandwidth bound."""
    runs, copies = recorded(monkeypatch)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os\\nimport sys\\n"}\n{"prompt": "class Node:\\n    def __init__(self"}\n')
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--prompts", str(prompts), "--max-new-tokens", "12",
                 "--repeats", "2", "--baselines", "hf,hf-assisted,ar,serial", "--json", str(out), "--plot", str(png),
                 "--set", "serving.speculation=always"]) == 0  # (adaptive may choose plain steps throughout)
    report = json.loads(out.read_text())
    assert set(report["systems"]) == set(runs) == {"specgraph", "hf", "hf-assisted", "ar"}
    assert report["skipped"] == {"serial": "the recipe already runs on the serial executor"}
    rates = {}
    for name, r in report["systems"].items():
        assert len(runs[name]) == 6  # 2 prompts: warm-up, then 2 repeats
        repeats = [runs[name][2:4], runs[name][4:]]
        rates[name] = [decode_rate(repeat) for repeat in repeats]
        tps = r["tokens_per_second"]
        assert tps["runs"] == pytest.approx(rates[name])
        assert (tps["min"], tps["median"], tps["max"]) == pytest.approx((min(rates[name]), sum(rates[name]) / 2,
                                                                         max(rates[name])))
        last = [run for _, run in repeats[-1]]
        assert r["ttft_seconds"] == pytest.approx((last[0].first_token_seconds + last[1].first_token_seconds) / 2)
        steps = [n for run in last for n in run.accepted_lengths]
        assert r["accepted_lengths"] == steps
        if steps:
            assert r["mean_accepted_length"] == pytest.approx(sum(steps) / len(steps))
            assert r["draft_step_ms"] == pytest.approx(1e3 * sum(run.draft_seconds for run in last) / len(steps))
            assert r["verify_step_ms"] == pytest.approx(1e3 * sum(run.verify_seconds for run in last) / len(steps))
        assert r["same_tokens_as_ar"] == 1.0  # fp32 on the CPU: all exact
    assert report["systems"]["specgraph"]["mean_accepted_length"] > 1
    assert report["systems"]["ar"]["mean_accepted_length"] == 1
    median = {name: sum(r) / 2 for name, r in rates.items()}
    assert report["speedup"] == pytest.approx({name: median["specgraph"] / m for name, m in median.items()
                                               if name != "specgraph"})
    bound, config = report["bandwidth_bound"], json.loads((EMBEDDED / "target" / "config.json").read_text())
    target = load_model(EMBEDDED / "target", torch.float32, "cpu")
    params = sum(p.numel() for p in {id(p): p for p in target.parameters()}.values())
    unread = 0 if target.lm_head.weight is target.embed_tokens.weight else (target.shape.vocab_size - 1) * target.shape.hidden_size
    assert bound["weight_bytes"] == (params - unread) * 4  # the embedding table: one row per token
    # per token, every weight and the K and V of the mean context: the prompt and half the new tokens
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    ar = runs["ar"][4:]
    context = sum(length + len(run.output_ids) / 2 for length, run in ar) / len(ar)
    assert bound["bytes_per_token"] == pytest.approx(bound["weight_bytes"] + kv * context)
    assert len(copies) == 1  # one timing: a 1 GiB copy, read and written
    assert bound["copy_bandwidth_bytes_per_s"] == pytest.approx(2 * 2**30 / copies[0])
    assert bound["tokens_per_second"] == pytest.approx(bound["copy_bandwidth_bytes_per_s"] / bound["bytes_per_token"])
    assert bound["ar_fraction"] == pytest.approx(median["ar"] / bound["tokens_per_second"])
    assert png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    table = printed.index("specgraph ÷")
    for name, r in report["systems"].items():  # each system's line as it finished, before the table (kept if a time
        line = f"{name}: {r['tokens_per_second']['median']:.1f} tok/s"  # limit stops the run later)
        assert 0 <= printed.find(line) < table, name


def test_a_recipe_file_baseline_runs_its_trees_over_the_recipes_models(tmp_path, monkeypatch):
    """A tuned recipe against the hand-written one in one run: the file's trees decode as that recipe
    does when loaded on its own (its steps' accepted lengths), the recipe's as the recipe does, and
    no model is loaded twice."""
    import specgraph.program

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os\\nimport sys\\n"}\n{"prompt": "class Node:\\n    def __init__(self"}\n')
    always = ["serving.speculation=always"]  # (accepted lengths compared step for step: no policy choosing modes)
    demo = Recipe.from_yaml(REPO / "recipes" / "demo.yaml", always)
    tuned = tmp_path / "elsewhere" / "tuned.yml"  # another folder: its model paths are written relative to it
    tuned.parent.mkdir()
    variant = demo.with_tree(0, DynamicTree(shape="dynamic", width=2, depth=3, nodes=6))
    tuned.write_text(variant.model_copy(update={"name": "tuned", "max_new_tokens": 99}).to_yaml(tuned.parent))
    loads = []
    load_model = specgraph.lower.load_model
    monkeypatch.setattr(specgraph.lower, "load_model", lambda path, *a: loads.append(path) or load_model(path, *a))
    out = tmp_path / "bench.json"
    # --set applies to the file too, a relative model path as the recipe's folder resolves it (the file is elsewhere)
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--prompts", str(prompts), "--max-new-tokens", "12",
                 "--repeats", "1", "--baselines", f"ar,{tuned}", "--json", str(out),
                 "--set", "models.draft.path=models/draft", "--set", always[0]]) == 0
    assert sorted(p.name for p in loads) == ["draft", "target"]  # the recipe's models, once each
    report = json.loads(out.read_text())
    assert list(report["systems"]) == ["specgraph", "ar", str(tuned)]
    ours, theirs = report["systems"]["specgraph"], report["systems"][str(tuned)]
    assert "trees (draft: dynamic width=2 depth=3 nodes=6) over the recipe's models" in theirs["description"]
    rows = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    for result, recipe in ((ours, demo), (theirs, Recipe.from_yaml(tuned, always))):
        program = Program.from_recipe(recipe)
        steps = [n for prompt in rows for n in program.generate(program.encode(prompt), 12).accepted_lengths]
        assert result["accepted_lengths"] == steps and result["same_tokens_as_ar"] == 1.0
    assert ours["accepted_lengths"] != theirs["accepted_lengths"]


@pytest.mark.parametrize("change, expected", [
    ({"stages.1.verify.rule": "typical"}, "differs from the recipe in stages.1.verify ({'rule': 'typical'}; the "
                                          "recipe's: {'rule': 'greedy'})"),
    ({"models.draft.path": str(EMBEDDED / "target")}, "differs from the recipe in models ("),
    ({"sampling.temperature": 0.5}, "differs from the recipe in sampling ("),
    ({"stages.0.name": "small"}, "differs from the recipe in its stages (small, target; the recipe's: draft, target)"),
])
def test_a_recipe_file_baseline_that_differs_in_more_than_trees_is_a_one_line_error(tmp_path, capsys, change, expected):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    other = tmp_path / "other.yaml"
    other.write_text(Recipe.from_yaml(REPO / "recipes" / "demo.yaml").to_yaml(tmp_path))  # (then changed in place)
    other.write_text(Recipe.from_yaml(other, [f"{k}={v}" for k, v in change.items()]).to_yaml(tmp_path))
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--prompts", str(prompts), "--baselines",
                 f"ar,{other}"]) == 2
    err = capsys.readouterr().err
    assert f"specgraph: error: --baselines {other}: {expected}" in err and "Traceback" not in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("baselines, expected", [
    ("ar,fast", "--baselines: unknown 'fast'; valid: hf, hf-assisted, ar, serial, or a recipe file (.yaml) that "
                "differs from the recipe only in its stages' trees"),
    ("ar,ar", "--baselines: ar is given twice; name each system once"),
    ("ar,BROKEN", "--baselines BROKEN: stages.0.tree.width: "),
    ("ar,MISSING", "--baselines MISSING: recipe file MISSING does not exist"),
])
def test_bad_baselines_are_one_line_errors(tmp_path, capsys, baselines, expected):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')
    broken, missing = tmp_path / "broken.yaml", tmp_path / "missing.yaml"
    broken.write_text((REPO / "recipes" / "demo.yaml").read_text().replace("{shape: chain, length: 5}",
                                                                         "{shape: dynamic, width: 0}"))
    baselines = baselines.replace("BROKEN", str(broken)).replace("MISSING", str(missing))
    demo = str(REPO / "recipes" / "demo.yaml")
    assert main(["bench", demo, "--prompts", str(prompts), "--baselines", baselines]) == 2
    err = capsys.readouterr().err
    expected = expected.replace("BROKEN", str(broken)).replace("MISSING", str(missing))
    assert f"specgraph: error: {expected}" in err and "Traceback" not in err and err.count("\n") == 1, err


def test_a_failing_transformers_baseline_is_reported_not_fatal(tmp_path, monkeypatch):
    def fail(self, ids, max_new_tokens):
        raise RuntimeError("cannot compile this model\nmore detail")

    monkeypatch.setattr(HFSystem, "run", fail)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os\\n"}\n')
    out = tmp_path / "bench.json"
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--repeats", "1", "--baselines", "hf,ar", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"specgraph", "ar"}
    assert report["skipped"] == {"hf": "transformers failed in this run: RuntimeError: cannot compile this model"}


def test_warmup_decodes_the_first_prompts_untimed_then_every_prompt(tmp_path, monkeypatch, capsys):
    decoded = []
    run = SpecgraphSystem.run
    monkeypatch.setattr(SpecgraphSystem, "run", lambda self, ids, n: decoded.append((self.name, ids)) or run(self, ids, n))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("import os\n", "def f(x):", "class A:")))
    out = tmp_path / "bench.json"
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--repeats", "1", "--warmup", "1", "--baselines", "ar", "--json", str(out)]) == 0
    for name in ("specgraph", "ar"):
        ids = [i for n, i in decoded if n == name]
        assert len(ids) == 4 and ids[0] == ids[1] and len({tuple(i) for i in ids[1:]}) == 3  # first, then all three
    assert json.loads(out.read_text())["warmup_prompts"] == 1
    assert "(warm-up pass on 1)" in " ".join(capsys.readouterr().out.split())
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--prompts", str(prompts), "--warmup", "0"]) == 2
    assert "--warmup: must be at least 1 prompt (got 0)" in capsys.readouterr().err


def test_unknown_baseline_is_refused(capsys):
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--baselines", "vllm"]) == 2
    assert "--baselines: unknown 'vllm'; valid: hf, hf-assisted, ar, serial" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(SHAPES))
def test_named_shapes_have_the_real_parameter_count(name):
    shape, tied, real = SHAPES[name]
    assert abs(shape.parameter_count(tied) / real - 1) < 0.05


def test_fixtures_fit_their_shapes():
    draft, target = load_model(EMBEDDED / "draft", torch.float32, "cpu"), load_model(EMBEDDED / "target", torch.float32, "cpu")
    assert draft_shape_for(draft.shape) == "llama-3.2-1b" and draft_shape_for(target.shape) == "llama-3.2-3b"
    with pytest.raises(SpecgraphError, match="unknown shape 'gpt-5'"):
        widen(target, "gpt-5", "cpu", torch.float32)
    with pytest.raises(SpecgraphError, match="head_dim 64 != 128"):
        widen(draft, "llama-3-8b", "cpu", torch.float32)
    with pytest.raises(SpecgraphError, match="--widen qwen3.5-9b: the model does not fit it \\(a HybridShape does not fit a "
                                             "Llama model\\); shapes that fit it: llama-3.2-3b, llama-3-8b, llama-3-70b"):
        widen(target, "qwen3.5-9b", "cpu", torch.float32)


def test_a_shape_that_does_not_fit_names_the_stage_and_the_shapes_that_fit(capsys):
    """`bench recipes/chain.yaml --widen llama-3.2-1b`: the target's head dim is the 3B's, not the 1B's."""
    assert main(["bench", str(REPO / "recipes" / "chain.yaml"), "--prompt", "x", "--widen", "llama-3.2-1b",
                 "--baselines", "ar"]) == 2
    assert ("--widen llama-3.2-1b: stage target's model (models.target) does not fit it (head_dim 128 != 64); "
            "shapes that fit it: llama-3.2-3b, llama-3-8b, llama-3-70b") in capsys.readouterr().err
    hybrid = load_model(shared_model("hybrid"), torch.float32, "cpu").shape
    for name in ("qwen3.5-9b", "qwen3.5-27b"):
        assert widened_shape(hybrid, name)[0].rotary_dim == hybrid.rotary_dim


def test_widened_model_computes_the_same_function():
    small = load_model(EMBEDDED / "target", torch.float32, "cpu")
    wide = widen(small, REDUCED, "cpu", torch.float32)
    assert wide.lm_head.weight.shape == (5000, 640) and len(wide.layers) == 11
    ids = torch.randint(0, 4096, (40,))
    a, b = chain_logits(small, ids), chain_logits(wide, ids)
    assert b.shape[-1] == 4096  # only the trained vocabulary is served
    assert (a - b).abs().max() < 1e-4  # fp32; the padded zeros change only summation order
    # transformers runs the widened weights too (shared tensors), giving the same logits
    hf = hf_mirror(wide, read_config(EMBEDDED / "target"))
    with torch.no_grad():
        assert (hf(ids[None]).logits[0, :, :4096] - a).abs().max() < 1e-4


def test_widened_recipe_decodes_the_same_tokens():
    recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "chain", "length": 3}, max_new_tokens=40)
    graph = plan(recipe)
    small = Program(graph)
    models = {"target": widen(small.stages["target"].model, REDUCED, "cpu", torch.float32),
              "draft": widen(small.stages["draft"].model, LlamaShape(5000, 320, 768, 3, 6, 2, 64, 1e-5), "cpu",
                             torch.float32)}
    wide = Program(graph, models)
    [(ids, expected)] = hf_greedy(EMBEDDED / "target", [{"prompt": "def load(path):\n    with open(path) as f:\n"}], 40)
    assert wide.generate(ids).output_ids == expected and small.generate(ids).output_ids == expected


HYBRID_REDUCED = HybridShape(5000, 512, 1536, (LINEAR, LINEAR, LINEAR, FULL) * 3, 4, 2, 128, 32, 3, 9, 64, 64, 4,
                             1e-6)  # the Qwen3.5 layout (3 value heads per key head, as 27B) at a CPU-friendly size


def test_widened_hybrid_computes_the_same_function():
    hybrid = shared_model("hybrid")
    small = load_model(hybrid, torch.float32, "cpu")
    wide = widen(small, HYBRID_REDUCED, "cpu", torch.float32)
    assert len(wide.layers) == 12 and wide.layers[5].linear_attn.in_proj.weight.shape == (2 * 3 * 64 + 2 * 9 * 64 + 2 * 9, 512)  # q k v z b a
    ids = torch.randint(0, 4096, (150,))  # two prefill chunks
    a = chain_logits(small, ids)
    assert (chain_logits(wide, ids) - a).abs().max() < 1e-4  # fp32; the padded zeros change only summation order
    hf = hf_mirror(wide, read_config(hybrid))  # transformers agrees on the widened weights
    with torch.no_grad():
        assert (hf(ids[None]).logits[0, :, :4096] - a).abs().max() < 1e-4
    recipe = two_stage(hybrid, EMBEDDED / "draft", {"shape": "static", "branching": [3, 2, 1]}, max_new_tokens=40)
    wide_program = Program(plan(recipe), {"target": wide})
    [(prompt, expected)] = hf_greedy(hybrid, [{"prompt": "def load(path):\n    with open(path) as f:\n"}], 40)
    assert wide_program.generate(prompt).output_ids == expected


def test_a_sampling_recipe_is_not_compared_with_ar(tmp_path, capsys):
    """Lossless speculative sampling keeps the target's distribution, not ar's draws: where the recipe
    samples (sampling.yaml: temperature 0.8), `= ar` is null in the JSON and — in the table, every row."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def f():"}) + "\n")
    out = tmp_path / "bench.json"
    assert Recipe.from_yaml(REPO / "recipes" / "sampling.yaml").sampling.temperature > 0
    assert main(["bench", str(REPO / "recipes" / "sampling.yaml"), "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--repeats", "1", "--baselines", "ar", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {name: r["same_tokens_as_ar"] for name, r in report["systems"].items()} == {"specgraph": None, "ar": None}
    rows = [line.split("│") for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert [(row[1].strip(), row[-2].strip()) for row in rows] == [("specgraph", "—"), ("ar", "—")]


def test_bench_of_one_new_token_is_a_one_line_error(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def f():"}) + "\n")
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--prompts", str(prompts), "--max-new-tokens", "1",
                 "--baselines", "ar"]) == 2
    err = capsys.readouterr().err
    assert "specgraph: error: --max-new-tokens: bench measures decoding after the first token; give at least 2 " \
           "(got 1)" in err and "Traceback" not in err


def test_prompts_that_all_end_at_their_first_token_are_a_one_line_error(tmp_path, monkeypatch, capsys):
    from specgraph.bench.systems import Run, SpecgraphSystem

    monkeypatch.setattr(SpecgraphSystem, "run", lambda self, ids, max_new_tokens: Run([0], 0.01, 0.01))  # EOS at once
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "def f():"}) + "\n")
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--prompts", str(prompts), "--baselines", "ar"]) == 2
    err = capsys.readouterr().err
    assert "error: specgraph: every prompt ended at its first token (end of sequence): there is no decoding to " \
           "measure; give other prompts" in err and "Traceback" not in err


def test_bench_systems_draw_with_the_recipes_seed_and_count_auto_devices_as_gpus(monkeypatch):
    """The measured systems decode as `run` does with the recipe's sampling.seed; a stage on
    `devices: [auto]` is counted as one GPU where one is present."""
    from specgraph.bench.harness import BenchSpec, _gpus, build_systems

    recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "chain", "length": 3},
                       sampling={"temperature": 1.0, "seed": 7}, max_new_tokens=8)
    program = Program.from_recipe(recipe)
    systems, _ = build_systems(program, BenchSpec(recipe, [], 8, baselines=("ar",)))
    ids = program.encode("import os\nimport sys\n")
    for system, alone in zip(systems, (False, True)):
        reference = program.autoregressive() if alone else program
        assert system.run(ids, 8).output_ids == reference.generate(ids, 8, seed=7).output_ids
    assert any(systems[0].run(ids, 8).output_ids != program.generate(ids, 8, seed=s).output_ids for s in range(4))
    auto = recipe.model_copy(update={"stages": [s.model_copy(update={"devices": ["auto"]}) for s in recipe.stages]})
    monkeypatch.setattr(sys.modules["specgraph.passes.place"], "present_devices", lambda: ["cpu", "cuda:0"])
    assert _gpus(SpecGraph.from_recipe(auto)) == "1 GPU"
