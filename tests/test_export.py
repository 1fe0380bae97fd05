"""specgraph compile/export: packages that reload in a fresh process and decode the same tokens,
and a compile cache keyed by the recipe and library versions."""

import json
import subprocess
import sys

import pytest
from conftest import REPO
from helpers import LONG_PROMPT

from specgraph.cli import main
from specgraph.export import versions
from specgraph.program import Program
from specgraph.recipe import Recipe

DEMO = REPO / "recipes" / "demo.yaml"
SMALL = ["--set", "max_seq_len=400"]



@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("program")
    assert main(["compile", str(DEMO), "-o", str(out), *SMALL]) == 0
    return out


def test_exported_program_reloads_in_a_fresh_process_with_the_same_tokens(compiled, tmp_path):
    assert {p.name for p in compiled.iterdir()} == {"manifest.json", "draft.pt2", "target.pt2"}
    stages = json.loads((compiled / "manifest.json").read_text())["stages"]
    assert stages["target"]["verifies"] == "draft" and stages["draft"]["verifies"] is None  # the topology
    assert stages["draft"]["tree_nodes"] == 5 and stages["target"]["cache_slots"] == 400 + 1 + 5  # chain 5
    assert stages["target"]["max_step_tokens"] == 64
    result = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "specgraph.cli", "run", "--program", str(compiled), "--prompt", LONG_PROMPT,
                           "--max-new-tokens", "40", "--json", str(result)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    exported = json.loads(result.read_text())["results"][0]
    eager = Program.from_recipe(Recipe.from_yaml(DEMO, ["max_seq_len=400"]))
    expected = eager.generate(eager.encode(LONG_PROMPT), 40)
    assert exported["output_ids"] == expected.output_ids
    assert exported["accepted_lengths"] == expected.accepted_lengths


def test_compile_cache_reuses_and_names_what_changed(compiled, capsys):
    assert main(["compile", str(DEMO), "-o", str(compiled), *SMALL]) == 0
    assert "compiled program is up to date" in capsys.readouterr().err
    before = json.loads((compiled / "manifest.json").read_text())["key"]
    assert main(["export", str(DEMO), "-o", str(compiled), *SMALL, "--set", "max_new_tokens=99"]) == 0
    assert "recompiling: max_new_tokens changed" in capsys.readouterr().err
    assert json.loads((compiled / "manifest.json").read_text())["key"] != before


def test_run_program_errors(tmp_path, capsys):
    assert main(["run", "--program", str(tmp_path)]) == 2
    assert f"--program: {tmp_path} has no manifest.json" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text(json.dumps({"key": "k", "versions": {**versions(), "specgraph_source": "0"}}))
    assert main(["run", "--program", str(tmp_path)]) == 2  # compiled by other code
    assert (f"--program: {tmp_path} was compiled with another specgraph_source (0, here {versions()['specgraph_source']}); "
            "compile it again") in capsys.readouterr().err
    assert main(["run"]) == 2
    assert "give a RECIPE file or --program DIR" in capsys.readouterr().err
