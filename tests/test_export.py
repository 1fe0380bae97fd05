"""specgraph compile/export: packages that reload in a fresh process and decode the same tokens,
and a compile cache keyed by the recipe and library versions."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from helpers import LONG_PROMPT, unwritable_folder, weight_reads

from specgraph.cli import main
from specgraph.export import versions
from specgraph.program import Program
from specgraph.recipe import Recipe

DEMO = REPO / "recipes" / "demo.yaml"
SMALL = ["--set", "max_seq_len=400", "--set", "serving.speculation=always"]  # (always: the same steps in every process)



@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("program")
    assert main(["compile", str(DEMO), "-o", str(out), *SMALL]) == 0
    return out


def test_exported_program_reloads_in_a_fresh_process_with_the_same_tokens(compiled, tmp_path):
    assert {p.name for p in compiled.iterdir()} == {"manifest.json", "draft.pt2", "target.pt2", "models"}
    assert {p.name for p in (compiled / "models" / "target").iterdir()} >= {"config.json", "tokenizer.json"}
    stages = json.loads((compiled / "manifest.json").read_text())["stages"]
    assert stages["target"]["verifies"] == "draft" and stages["draft"]["verifies"] is None  # the topology
    assert stages["draft"]["tree_nodes"] == 5 and stages["target"]["cache_slots"] == 400 + 1 + 5  # chain 5
    assert stages["target"]["max_step_tokens"] == 64
    result = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "specgraph.cli", "run", "--program", str(compiled), "--prompt", LONG_PROMPT,
                           "--max-new-tokens", "40", "--json", str(result)], capture_output=True, text=True,
                          cwd=tmp_path)  # another working folder: the program folder holds what it needs
    assert proc.returncode == 0, proc.stderr
    exported = json.loads(result.read_text())["results"][0]
    eager = Program.from_recipe(Recipe.from_yaml(DEMO, SMALL[1::2]))
    expected = eager.generate(eager.encode(LONG_PROMPT), 40)
    assert exported["output_ids"] == expected.output_ids
    assert exported["accepted_lengths"] == expected.accepted_lengths


def test_compile_cache_reuses_and_names_what_changed(compiled, tmp_path, capsys, monkeypatch):
    """(The recompile's packages are placeholders: what is tested is which folder is reused and what the
    message names; the packages' compile and reload are the test above's.)"""
    import torch

    copy = tmp_path / "program"
    shutil.copytree(compiled, copy)
    assert main(["compile", str(DEMO), "-o", str(copy), *SMALL]) == 0
    assert "compiled program is up to date" in capsys.readouterr().err
    before = json.loads((copy / "manifest.json").read_text())["key"]
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package",
                        lambda exported, package_path: Path(package_path).write_bytes(b"placeholder"))
    assert main(["export", str(DEMO), "-o", str(copy), *SMALL, "--set", "max_new_tokens=99"]) == 0
    assert "recompiling: max_new_tokens changed" in capsys.readouterr().err
    assert json.loads((copy / "manifest.json").read_text())["key"] != before


def test_run_program_errors(tmp_path, capsys):
    assert main(["run", "--program", str(tmp_path)]) == 2
    assert f"--program: {tmp_path} has no manifest.json" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text(json.dumps({"key": "k", "versions": {**versions(), "specgraph_source": "0"}}))
    assert main(["run", "--program", str(tmp_path)]) == 2  # compiled by other code
    assert (f"--program: {tmp_path} was compiled with another specgraph_source (0, here {versions()['specgraph_source']}); "
            "compile it again") in capsys.readouterr().err
    assert main(["run"]) == 2
    assert "give a RECIPE file or --program DIR" in capsys.readouterr().err


def edited_copy(compiled, tmp_path, edit) -> "Path":
    copy = tmp_path / "copy"
    shutil.copytree(compiled, copy)
    edit(copy)
    return copy


def edit_manifest(change):
    def edit(folder):
        manifest = json.loads((folder / "manifest.json").read_text())
        change(manifest)
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return edit


@pytest.mark.parametrize("edit, expected", [
    (edit_manifest(lambda m: m["stages"]["target"]["shape"].update(num_layers=3)), "was edited"),
    (edit_manifest(lambda m: m["recipe"].update(max_seq_len=9999)), "was edited"),
    (edit_manifest(lambda m: m.update(key="0" * 64)), "was edited"),
    (edit_manifest(lambda m: m["recipe"]["models"]["target"].update(path="/elsewhere")), "was edited"),
    (edit_manifest(lambda m: m.pop("stages")), "lacks 'stages'"),
    (lambda f: (f / "manifest.json").write_text("{not json"), "is not JSON"),
    (lambda f: (f / "target.pt2").write_bytes((f / "target.pt2").read_bytes()[:1000]), "was changed or damaged"),
    (lambda f: (f / "models" / "draft" / "tokenizer.json").unlink(), "is missing"),
], ids=["layers", "max-seq-len", "key", "model-path", "no-stages", "not-json", "truncated-package", "missing-file"])
def test_an_edited_or_damaged_program_folder_is_refused_before_loading(compiled, tmp_path, edit, expected, capsys):
    folder = edited_copy(compiled, tmp_path, edit)
    assert main(["run", "--program", str(folder), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specgraph: error: --program: ") and expected in err[-1], err


def test_compile_never_overwrites_what_is_not_a_program(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "target.pt2").write_text("the user's own file")
    assert main(["compile", str(DEMO), "-o", str(mine), *SMALL]) == 2
    assert "holds files that are not a specgraph program" in capsys.readouterr().err
    assert (mine / "target.pt2").read_text() == "the user's own file"
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    assert main(["compile", str(DEMO), "-o", str(afile)]) == 2
    assert f"-o: {afile} is a file; give a folder" in capsys.readouterr().err


def test_a_folder_that_cannot_be_made_or_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    reads = weight_reads(monkeypatch)
    afile = tmp_path / "a.txt"
    afile.write_text("mine")
    readonly, reason = unwritable_folder(tmp_path)
    for out, named, why in ((Path("/proc/p"), "/proc/p", "No such file or directory"),
                            (afile / "p", afile / "p", "Not a directory"),
                            (readonly / "p" / "q", readonly / "p", reason), (readonly, readonly / "manifest.json", reason)):
        assert main(["compile", str(DEMO), "-o", str(out)]) == 2
        assert capsys.readouterr().err == (f"specgraph: error: -o: {named} cannot be written ({why}); "
                                           "give a path in a folder you can write\n")
        assert reads == []  # before loading the models
    assert afile.read_text() == "mine" and not (readonly / "p").exists()


def test_a_row_invariant_recipe_is_not_exported(tmp_path, capsys, monkeypatch):
    reads = weight_reads(monkeypatch)
    assert main(["compile", str(DEMO), "-o", str(tmp_path / "p"), *SMALL, "--set", "lowering.row_invariant=true"]) == 2
    assert capsys.readouterr().err.strip().endswith("lowering.row_invariant: an exported program runs AOTInductor's "
                                                    "code for plain PyTorch ops, whose rows are not invariant; run the "
                                                    "recipe itself (specgraph run RECIPE)")
    assert not (tmp_path / "p").exists() and reads == []  # refused before loading the models
