"""Every user path works or says why in one line (exit status 2, no traceback): sampling without a
drafter, output paths, damaged checkpoints and prompt files, results kept when a prompt fails or
the user presses Ctrl-C, consistent figures, threads."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import stat
from pathlib import Path

import pytest
from conftest import EMBEDDED, REPO
from helpers import PROMPT, character_device, interruptible, unwritable_folder, weight_reads

from specgraph.cli import default_threads, main
from specgraph.errors import CheckpointError, PromptError
from specgraph.program import Program
from specgraph.recipe import Recipe

DEMO = REPO / "recipes" / "demo.yaml"


def one_line_error(capsys, expected: str) -> str:
    """Check that stderr ends in one error line holding `expected`, with no traceback; stdout."""
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert err[-1].startswith("specgraph: error: ") and expected in err[-1], err
    assert not any("Traceback" in line for line in err)
    return captured.out


def test_sampling_with_no_drafter_runs_from_the_cli_and_bench(tmp_path):
    out = tmp_path / "out.json"
    assert main(["run", str(REPO / "recipes" / "autoregressive.yaml"), "--set", "sampling.temperature=0.8",
                 "--prompt", PROMPT, "--max-new-tokens", "8", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["results"][0]["output_ids"]) == 8
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    bench = tmp_path / "bench.json"
    assert main(["bench", str(REPO / "recipes" / "sampling.yaml"), "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--repeats", "1", "--baselines", "ar", "--json", str(bench)]) == 0
    assert set(json.loads(bench.read_text())["systems"]) == {"specgraph", "ar"}


@pytest.mark.parametrize("command", [
    ["run", str(DEMO), "--prompt", "x", "--json"],
    ["bench", str(DEMO), "--prompt", "x", "--json"],
    ["bench", str(DEMO), "--prompt", "x", "--plot"],
    ["inspect", str(DEMO), "--dot"],
    ["tune", str(DEMO), "--prompt", "x", "-o"],
], ids=["run-json", "bench-json", "bench-plot", "inspect-dot", "tune-o"])
def test_output_paths_are_checked_before_any_work(command, tmp_path, capsys, monkeypatch):
    reads = weight_reads(monkeypatch)
    afile = tmp_path / "a.txt"
    afile.write_text("mine")
    readonly, reason = unwritable_folder(tmp_path)
    dangling = tmp_path / "dangling.png"
    dangling.symlink_to(tmp_path / "no" / "out.png")
    cases = [(Path("/proc/out.png"), "cannot be written (No such file or directory)"),
             (afile / "out.png", "cannot be written (Not a directory)"),
             (dangling, "cannot be written (No such file or directory)"),
             (readonly / "out.png", f"cannot be written ({reason})"),
             (tmp_path / "no" / "out.png", "cannot be written (No such file or directory)"), (tmp_path, "is a folder")]
    for path, expected in cases:
        assert main([*command, str(path)]) == 2
        assert "new tokens" not in one_line_error(capsys, f"{command[-1]}: {path} {expected}")  # nothing decoded
        assert reads == []  # refused before loading any model
    assert afile.read_text() == "mine" and not (tmp_path / "no").exists() and not (readonly / "out.png").exists()


def test_outputs_go_through_symlinks_and_into_devices(tmp_path, capsys):
    target, link = tmp_path / "graph.dot", tmp_path / "link.dot"
    target.write_text("old")
    link.symlink_to(target)
    device = character_device(tmp_path)
    device_before = os.stat(device)
    for path in (link, device):
        assert main(["inspect", str(DEMO), "--dot", str(path)]) == 0
    assert os.readlink(link) == str(target) and target.read_text().startswith("digraph")
    assert stat.S_ISCHR(os.lstat(device).st_mode) and os.lstat(device).st_ino == device_before.st_ino
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def damaged_checkpoint(tmp_path, how: str):
    folder = tmp_path / how
    shutil.copytree(EMBEDDED / "draft", folder)
    weights = folder / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "foreign":
        weights.write_bytes(b"PK\x03\x04 not safetensors at all")
    elif how == "reshaped":
        config = json.loads((folder / "config.json").read_text())
        config["intermediate_size"] += 8
        (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("how", ["truncated", "foreign", "reshaped"])
def test_a_damaged_checkpoint_is_one_line(how, tmp_path, capsys):
    folder = damaged_checkpoint(tmp_path, how)
    assert main(["run", str(DEMO), "--set", f"models.draft.path={folder}", "--prompt", "x", "--max-new-tokens", "2"]) == 2
    one_line_error(capsys, str(folder))


def test_a_prompt_file_that_is_not_utf8(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_bytes(b'{"prompt": "caf\xe9"}\n')
    assert main(["run", str(DEMO), "--prompts", str(bad)]) == 2
    one_line_error(capsys, "is not UTF-8 text")


def test_a_failing_prompt_is_skipped_and_the_others_kept(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": i, "prompt": p}) for i, p in
                                 [("short", "import os\n"), ("long", "x = 1\n" * 60), ("also", "def f():\n")]) + "\n")
    out = tmp_path / "out.json"
    assert main(["run", str(DEMO), "--prompts", str(prompts), "--max-new-tokens", "4", "--set", "max_seq_len=64",
                 "--json", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()  # (standard error is no terminal here: no progress bar in the lines)
    assert all(line.startswith("specgraph: ") for line in err), err
    [named] = [line for line in err if "long" in line]  # once, with why
    assert re.fullmatch(r"specgraph: error: prompt long: a prompt of \d+ tokens does not fit: prompts need 1 to 63 "
                        r"tokens \(max_seq_len 64\); skipped", named), named
    assert err[-1] == "specgraph: error: 1 of 3 prompts could not be decoded and were skipped (each named above)"
    data = json.loads(out.read_text())
    assert [r["id"] for r in data["results"]] == ["short", "also"] and data["errors"][0]["id"] == "long"
    assert "interrupted" not in data and "failed" not in data  # (a skipped prompt does not stop the run)


def test_duplicate_prompt_ids_are_refused_before_any_work(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n{"prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    assert main(["run", str(DEMO), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert f"--prompts: {prompts} line 3: id 'a' is line 1's too" in err and "loading" not in err


def test_generating_an_id_outside_the_vocabulary_names_it():
    program = Program.from_recipe(Recipe.from_yaml(DEMO))
    with pytest.raises(PromptError, match=r"prompt token 99999 \(at 1\) is outside the vocabulary: ids are 0 to 4095"):
        program.generate([5, 99999], 4)


def test_ctrl_c_writes_the_finished_prompts(tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": PROMPT}) + "\n" for i in range(200)))
    out = tmp_path / "out.json"
    terminal, stderr = pty.openpty()  # stderr on a terminal, as a user at one sees it: the bar is drawn
    fcntl.ioctl(stderr, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # (a new pty is 0 columns wide)
    proc = subprocess.Popen([sys.executable, "-m", "specgraph", "run", str(DEMO), "--prompts", str(prompts),
                             "--max-new-tokens", "24", "--json", str(out)], stderr=stderr, stdout=subprocess.DEVNULL,
                            preexec_fn=interruptible)
    os.close(stderr)
    seen = ""
    try:
        while max(map(int, re.findall(r"(\d+)/200", seen)), default=0) < 2:  # the progress bar: two prompts done
            seen += os.read(terminal, 4096).decode(errors="replace")
            assert proc.poll() is None, seen
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        os.close(terminal)
    assert proc.returncode == 130, seen[-3000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert 2 <= len(results) < 200 and [r["id"] for r in results] == [str(i) for i in range(len(results))]
    assert report["interrupted"] is True  # a reader can tell a cut-short file from a whole one


def test_token_budgets_and_clipping_are_reported_as_they_are(tmp_path, capsys):
    program = Program.from_recipe(Recipe.from_yaml(DEMO, ["max_seq_len=64"]))
    ids = program.encode(PROMPT)
    for bad in (0, -1):
        with pytest.raises(PromptError, match="max_new_tokens: must be a whole number of at least 1"):
            program.generate(ids, bad)
    one = program.generate(ids, 1)
    assert len(one.output_ids) == 1 and one.accepted_lengths == [1] and not one.clipped
    clipped = program.generate(ids, 200)
    assert clipped.clipped and len(clipped.output_ids) == 64 - len(ids) == sum(clipped.accepted_lengths)
    out = tmp_path / "out.json"
    assert main(["run", str(DEMO), "--prompt", PROMPT, "--set", "max_seq_len=64", "--max-new-tokens", "200",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["clipped"] is True
    assert "max_seq_len 64 cut it to" in capsys.readouterr().err


def test_a_baseline_that_did_not_run_shows_no_agreement(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    out = tmp_path / "bench.json"
    assert main(["bench", str(DEMO), "--prompts", str(prompts), "--max-new-tokens", "6", "--repeats", "1",
                 "--baselines", "hf", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert all(r["same_tokens_as_ar"] is None for r in report["systems"].values())
    assert "100%" not in capsys.readouterr().out


def test_a_reindented_tokenizer_is_the_same_and_another_vocabulary_is_not(tmp_path, capsys):
    folder = tmp_path / "draft"
    shutil.copytree(EMBEDDED / "draft", folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, indent=7))
    assert main(["run", str(DEMO), "--set", f"models.draft.path={folder}", "--prompt", "x", "--max-new-tokens", "2"]) == 0
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(CheckpointError, match="tokenizer differs"):
        Program.from_recipe(Recipe.from_yaml(DEMO, [f"models.draft.path={folder}"]))


def test_a_recipe_file_without_a_name_is_named_after_it(tmp_path):
    recipe = tmp_path / "my-recipe.yaml"
    recipe.write_text((REPO / "recipes" / "autoregressive.yaml").read_text().replace("name: autoregressive\n", "")
                      .replace("models/", str(EMBEDDED) + "/"))
    assert Recipe.from_yaml(recipe).name == "my-recipe"


def test_threads_default_to_the_free_cores_and_can_be_set(monkeypatch, capsys):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert default_threads() == cores
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 3.0, 0.0, 0.0))  # others keep every core busy
    assert default_threads() == 1
    assert main(["run", str(DEMO), "--prompt", "x", "--max-new-tokens", "2", "--threads", "1"]) == 0
    assert main(["run", str(DEMO), "--prompt", "x", "--threads", "0"]) == 2
    one_line_error(capsys, "--threads: must be at least 1")


def test_debug_shows_the_traceback(capsys):
    assert main(["run", "nowhere.yaml", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1] == "specgraph: error: recipe file nowhere.yaml does not exist"

