"""The command line: run (text and JSON output), inspect, and one-line errors for bad input."""

import json
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO
from helpers import weight_reads

from specgraph.cli import main

DEMO = REPO / "recipes" / "demo.yaml"


def test_run_writes_the_documented_json(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "import os\\n"}\n\n{"prompt": "def main():\\n"}\n')
    out = tmp_path / "out.json"
    start = time.perf_counter()
    assert main(["run", str(DEMO), "--prompts", str(prompts), "--max-new-tokens", "12", "--json", str(out)]) == 0
    measured = time.perf_counter() - start  # around everything: loading included
    data = json.loads(out.read_text())
    assert data["recipe"] == "demo" and [r["id"] for r in data["results"]] == ["a", "001"]
    for r in data["results"]:
        assert set(r) == {"id", "prompt_tokens", "output_ids", "text", "target_steps", "accepted_lengths",
                          "finish_reason"}
        assert r["finish_reason"] == ("length" if len(r["output_ids"]) == 12 else "stop")
        assert len(r["output_ids"]) <= 12 and r["target_steps"] == len(r["accepted_lengths"])
        assert sum(r["accepted_lengths"]) == len(r["output_ids"])  # each step's count is what it emitted
    summary = data["summary"]
    new_tokens = sum(len(r["output_ids"]) for r in data["results"])
    assert summary["new_tokens"] == new_tokens
    assert 0 < summary["wall_seconds"] < measured and summary["tokens_per_second"] > new_tokens / measured
    steps = sum(r["target_steps"] for r in data["results"])
    assert summary["mean_accepted_length"] == pytest.approx(new_tokens / steps, abs=1e-3)
    assert "tokens/s, mean accepted length" in capsys.readouterr().err


def test_run_prints_the_completion_of_one_prompt_and_its_summary_apart(tmp_path, capsys):
    """Standard output holds the prompt and its completion alone; the summary goes to standard error."""
    out = tmp_path / "out.json"
    assert main(["run", str(DEMO), "--prompt", "import numpy as np\n", "--max-new-tokens", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out == "import numpy as np\n" + json.loads(out.read_text())["results"][0]["text"] + "\n"
    assert "mean accepted length" in printed.err and "s to the first token" in printed.err
    assert "loading stage" not in printed.err  # (the build's steps: where someone watches, or asked)


def test_the_build_s_long_steps_are_shown(monkeypatch, capsys):
    """By default each stage's loading and the policy's timing of steps are shown as they start, a
    line each on standard error, then the summary with the build's seconds; SPECGRAPH_PROGRESS=1 adds
    each mode's measured times and a prompt token's cost to the drafter; SPECGRAPH_PROGRESS=0 (as conftest sets for the other tests) silences them."""
    steps = ["specgraph: loading demo (draft, target)"] + [
        f"specgraph: loading stage {name}: {REPO / 'recipes' / 'models' / name} (float32) on cpu"
        for name in ("draft", "target")] + [
        "specgraph: timing 4 step modes (ar, depth 5, depth 3, depth 1) at batch sizes [1] for the speculation policy"]
    monkeypatch.delenv("SPECGRAPH_PROGRESS")
    assert main(["run", str(DEMO), "--prompt", "import os\n", "--max-new-tokens", "2"]) == 0
    shown = capsys.readouterr().err.splitlines()
    assert shown[:4] == steps and re.fullmatch(r"specgraph: 2 new tokens in \d+\.\d\d s, after a \d+\.\d s build .*", shown[4])
    monkeypatch.setenv("SPECGRAPH_PROGRESS", "1")
    assert main(["run", str(DEMO), "--prompt", "import os\n", "--max-new-tokens", "2"]) == 0
    shown = capsys.readouterr().err.splitlines()
    timed = [re.fullmatch(r"specgraph: a step of (.+): (\d+\.\d\d) ms at batch sizes \[1\]", line) for line in shown[4:-2]]
    assert shown[:4] == steps and [m and m[1] for m in timed] == ["ar", "depth 1", "depth 3", "depth 5"]  # (shallowest first)
    assert re.fullmatch(r"specgraph: a prompt token costs the drafter \d+\.\d\d us \(its forward over \d+ tokens\)",
                        shown[-2])
    monkeypatch.setenv("SPECGRAPH_PROGRESS", "0")
    assert main(["run", str(DEMO), "--prompt", "import os\n", "--max-new-tokens", "2"]) == 0
    quiet = capsys.readouterr().err.splitlines()
    assert quiet[0] == steps[0] and len(quiet) == 2 and "new tokens in" in quiet[1]


def test_json_dash_is_standard_output(tmp_path, monkeypatch, capsys):
    """`--json -` writes the JSON to standard output, alone there (no file named '-'); several
    prompts' first-token time says that it counts the wait behind earlier prompts."""
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": null, "prompt": "import os\\n"}\n{"id": 7, "prompt": "def main():\\n"}\n')
    assert main(["run", str(DEMO), "--prompts", str(prompts), "--max-new-tokens", "4", "--json", "-"]) == 0
    printed = capsys.readouterr()
    report = json.loads(printed.out)
    assert [r["id"] for r in report["results"]] == ["000", "7"]  # (a null id: the prompt's number, not "None")
    assert not (tmp_path / "-").exists()
    assert "its wait behind earlier prompts" in printed.err
    assert main(["run", str(DEMO), "--prompt", "import os\n", "--max-new-tokens", "4", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["id"] == "000"  # (the completion went to stderr)


def test_seeded_sampling_is_reproducible(tmp_path):
    args = ["run", str(REPO / "recipes" / "sampling.yaml"), "--prompt", "class Tree:\n", "--max-new-tokens", "24"]
    runs = []
    for seed in (1, 1, 2):
        out = tmp_path / f"{len(runs)}.json"
        assert main([*args, "--set", f"sampling.seed={seed}", "--json", str(out)]) == 0
        runs.append(json.loads(out.read_text())["results"][0]["output_ids"])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_inspect_shows_every_pass_and_writes_dot(tmp_path, capsys):
    dot = tmp_path / "g.dot"
    assert main(["inspect", str(REPO / "recipes" / "tree.yaml"), "--dot", str(dot)]) == 0
    out = capsys.readouterr().out
    for name in ("validate", "place", "plan_tree", "plan_memory", "compile_stages", "capture_graphs"):
        assert f"after {name}" in out
    assert "cache_slots" in out and "--verifies--> target" in out
    assert '"draft" -> "target"' in dot.read_text()
    annotations = [line for line in out.splitlines() if line.startswith("        ")]  # one line per annotation
    assert all(re.fullmatch(r"        \w+ = .{1,100}", line) for line in annotations), annotations
    assert "config = LlamaConfig (LlamaForCausalLM: 2 layers, hidden 192, vocab 4096)" in out


def test_a_drafter_larger_than_its_target_is_warned_of_in_one_line(capsys):
    assert main(["inspect", str(DEMO)]) == 0
    assert "warning" not in capsys.readouterr().err
    swapped = ["--set", "models.draft.path=models/target", "--set", "models.target.path=models/draft"]
    assert main(["inspect", str(DEMO), *swapped]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warned == ["specgraph: warning: stage draft (14.2M parameters) drafts for stage target, which is no larger "
                      "(1.6M): speculation pays when the drafter is much smaller; check models and stages"]


@pytest.mark.parametrize("args, expected", [
    (["run", "nowhere.yaml"], "recipe file nowhere.yaml does not exist"),
    (["run", str(DEMO), "--set", "stages.0.tree.nodes=0"], "stages.0.tree.nodes: unknown key; valid keys here: shape, length"),
    (["run", str(DEMO), "--set", "stages.0.tree={shape: dynamic, nodes: 0}"], "stages.0.tree.nodes: Input should be greater than 0"),
    (["run", str(DEMO), "--set", "models.target.path=/no/such/model"], "models.target.path: /no/such/model: checkpoint folder does not exist"),
    (["run", str(DEMO), "--set", "stages.1.devices=[cuda:3]"], "stages.1.devices.0: device cuda:3 is not present"),
    (["run", str(DEMO), "--prompts", "none.jsonl"], "--prompts: none.jsonl does not exist"),
    (["run", str(DEMO), "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["run", str(DEMO), "--set", "max_seq_len=8", "--prompt", "x = 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8"],
     "does not fit: prompts need 1 to 7 tokens (max_seq_len 8)"),
    (["run", str(DEMO), "--prompt", "caf\udce9"], "--prompt: not UTF-8 text (byte 0xe9 at character 3)"),
    (["bench", str(DEMO), "--prompt", "\udcff"], "--prompt: not UTF-8 text (byte 0xff at character 0)"),
    (["run", str(DEMO), "--set", "serving.kv_blocks=1"], "serving.kv_blocks: 1 blocks of 64 slots cannot hold one "
     "request of max_seq_len 2048 tokens and a step's 7 more (and block 0, the trash); give at least 34"),  # 1 + 2055 / 64
    (["run", str(DEMO), "--set", "serving.kv_blocks=3"], "give at least 34"),
    (["run", str(DEMO), "--set", "stages.0.tree={shape: chain, length: 5000}"],
     "stages.0.tree: a chain of 5000 draft tokens cannot fit max_seq_len 2048"),
    (["run", str(DEMO), "--set", "stages.0.tree={shape: static, branching: [8, 8, 8, 8, 8, 8, 8, 8, 8, 8]}"],
     "stages.0.tree: branching [8, 8, 8, 8, 8, 8, 8, 8, 8, 8] (4680+ nodes) cannot fit max_seq_len 2048"),
    (["run", str(DEMO), "--set", "stages.0.tree={shape: dynamic, width: 1, depth: 3000, nodes: 30}"],
     "stages.0.tree: depth 3000 x width 1 (2999 nodes fed per step) cannot fit max_seq_len 2048"),
    (["run", str(DEMO), "--set", "stages.0.tree={shape: dynamic, width: 64, depth: 2, nodes: 2048}"],
     "stages.0.tree: 2048 verified nodes cannot fit max_seq_len 2048"),
    (["run", str(DEMO), "--set", "max_seq_len=1"], "max_seq_len: Input should be greater than or equal to 2 (got 1)"),
    (["run", str(DEMO), "--set", "serving.block_size=17"],
     "serving.block_size: must be a power of two of at least 16, e.g. 64 (got 17)"),
    (["serve", str(REPO / "recipes" / "models" / "target"), "--draft", "/nonexistent"], "--draft: /nonexistent is "
     "neither a folder nor a model in the Hugging Face cache"),
    (["serve", str(REPO / "recipes" / "models" / "target"), "--draft", str(DEMO)], f"--draft: {DEMO} is a file; a "
     "drafter is a checkpoint folder or a hub id (ORG/NAME, downloaded with `hf download ORG/NAME`), not a recipe"),
])
def test_bad_input_exits_with_one_line(args, expected, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specgraph: error: ") and expected in err[-1]
    assert err[-1].count("(got") <= 1 and not any("Traceback" in line for line in err)


@pytest.mark.parametrize("command", ["run", "bench", "tune"])
def test_an_empty_prompt_is_one_line_before_loading(command, tmp_path, monkeypatch, capsys):
    reads = weight_reads(monkeypatch)
    assert main([command, str(DEMO), "--prompt", "", *(["-o", str(tmp_path / "t.yaml")] if command == "tune" else [])
                 ]) == 2
    assert reads == []
    assert capsys.readouterr().err.splitlines() == [
        "specgraph: error: --prompt: empty; give the text to continue (a prompt needs at least one token)"]


def test_a_prompt_that_does_not_fit_is_one_line(capsys):
    """(after loading: the tokenizer counts its tokens)"""
    assert main(["run", str(DEMO), "--set", "max_seq_len=8", "--prompt", "x = 1 + 2 + 3 + 4 + 5 + 6 + 7 + 8"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("specgraph: loading")]
    assert len(err) == 1 and re.fullmatch(r"specgraph: error: --prompt: a prompt of \d+ tokens does not fit: prompts "
                                          r"need 1 to 7 tokens \(max_seq_len 8\)", err[0]), err


def test_a_batch_whose_pool_outgrows_memory_is_refused_before_loading(monkeypatch, capsys):
    """The demo pool per slot: 2 (K, V) x layers x KV heads x head dim x 4 bytes, the target's
    (8 x 1 x 128) and the drafter's (2 x 1 x 64), over 1 + batch x ceil(2055 / 64) blocks of 64."""
    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 8 * 10 ** 9}))
    reads = weight_reads(monkeypatch)
    need = (1 + 100000 * 33) * 64 * 2 * (8 * 128 + 2 * 64) * 4
    assert main(["run", str(DEMO), "--batch", "100000"]) == 2
    assert reads == []  # refused before a weight was read
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"specgraph: error: serving.max_batch (--batch): 100000 requests at once need a KV pool of "
                       f"{need / 1e9:.1f} GB on cpu, which has 8.0 GB available; at most {100000 * 8 * 10 ** 9 // need} fit")


def test_the_libraries_warnings_show_with_debug_only(monkeypatch, recwarn, capsys):
    """A command's own warnings are one line; torch's and transformers' (a FutureWarning, a logger's
    advice) are for their developers: passed on with --debug only (warnings to pytest's recorder,
    which stands in for standard error here)."""
    import logging
    import warnings

    from transformers.utils import logging as transformers_logging

    from specgraph import cli
    from specgraph.errors import RecipeWarning

    advice = []  # whether transformers' logger would print its advice, per command

    def noisy(args):
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning)
        advice.append(transformers_logging.get_logger("transformers.generation").isEnabledFor(logging.WARNING))
        warnings.warn(RecipeWarning("a drafter no smaller than its target"))

    monkeypatch.setattr(cli, "cmd_inspect", noisy)
    assert main(["inspect", str(DEMO)]) == 0
    assert capsys.readouterr().err.splitlines() == ["specgraph: warning: a drafter no smaller than its target"]
    assert not [w for w in recwarn if w.category is FutureWarning]
    assert main(["inspect", str(DEMO), "--debug"]) == 0
    assert [w for w in recwarn if w.category is FutureWarning] and advice == [False, True]


def test_train_draft_refuses_a_vocabulary_larger_than_the_targets(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "def f(x):\\n    return x\\n"}\n')
    assert main(["train-draft", str(REPO / "recipes" / "models" / "target"), "--data", str(data), "-o",
                 str(tmp_path / "head"), "--draft-vocab", "99999"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "specgraph: error: --draft-vocab: 99999 is more than the target's vocabulary of 4096; give at most 4096")
    assert not (tmp_path / "head").exists()


def test_bad_prompt_files(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json}\n')
    assert main(["run", str(DEMO), "--prompts", str(bad)]) == 2
    assert "line 2 is not JSON" in capsys.readouterr().err
    bad.write_text('{"text": "no prompt key"}\n')
    assert main(["run", str(DEMO), "--prompts", str(bad)]) == 2
    assert "line 1 needs a 'prompt' string" in capsys.readouterr().err
    bad.write_text('{"prompt": "x", "id": ["a"]}\n')
    assert main(["run", str(DEMO), "--prompts", str(bad)]) == 2
    assert "line 1: 'id' must be a string or a whole number (got [\"a\"])" in capsys.readouterr().err


def test_user_errors_print_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "specgraph.cli", "run", str(DEMO), "--set", "execution=pipeline",
                           "--set", "stages.0.tree={shape: static, branching: [2]}", "--set", "stages.1.verify.window=3"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "specgraph: error: stages.1.verify.window: the stage above a first stage that drafts a tree verifies the "
        "whole tree; give the tree's size instead (stages.0.tree)")


def test_device_flags_name_a_device_this_machine_has(monkeypatch):
    """--device (quantize --method awq, train-draft): cpu, or a CUDA GPU that is there."""
    import torch

    from specgraph.cli import device_flag
    from specgraph.errors import SpecgraphError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [device_flag(d) for d in ("cpu", "cuda", "cuda:1")] == [torch.device(d) for d in ("cpu", "cuda", "cuda:1")]
    with pytest.raises(SpecgraphError, match=re.escape("--device: cuda:2 asked for, but this machine has 2 CUDA GPUs "
                                                       "(cuda:0 to cuda:1)")):
        device_flag("cuda:2")
    for value in ("meta", "mps", "cpu:1", "gpu0"):
        with pytest.raises(SpecgraphError, match=re.escape(f"--device: {value!r} is not a device; valid: cpu, cuda")):
            device_flag(value)
