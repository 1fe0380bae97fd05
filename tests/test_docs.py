"""The docs as a new user meets them: a README that reads in five minutes, every command block in
it run as written from the repository root, the set-up commands the ones CI runs, and the recipe
reference equal to what scripts/recipe_reference.py writes from the code."""

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import REPO

README = (REPO / "README.md").read_text()
OUTPUTS = ["/tmp/specgraph-run.json", "/tmp/specgraph-program", "/tmp/specgraph-w4", "/tmp/specgraph-head"]
WAIT = 120  # seconds the README's server may take to start


def blocks(language: str) -> list[str]:
    """The README's fenced blocks of `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README, re.S | re.M)


SET_UP, *EXAMPLES = blocks("bash")
SERVE = next(block for block in EXAMPLES if block.startswith("specgraph serve"))


def test_the_readme_reads_in_five_minutes():
    assert len(README.split()) <= 1500


def test_the_recipe_reference_is_the_code():
    generated = subprocess.run([sys.executable, "scripts/recipe_reference.py"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout
    assert generated == (REPO / "docs" / "recipes.md").read_text(), (
        "docs/recipes.md differs from the code: python3 scripts/recipe_reference.py > docs/recipes.md")


def test_ci_runs_the_readme_set_up_commands():
    ci = (REPO / ".ci" / "run").read_text()
    assert " && ".join(SET_UP.strip().splitlines()) in ci


def run_block(block: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=REPO, capture_output=True, text=True,
                          timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in EXAMPLES if b is not SERVE], ids=lambda b: b.split()[1])
def test_a_readme_command_block_runs_as_written(block):
    for output in OUTPUTS:  # (what an earlier run left: quantize refuses a folder that exists)
        if output in block:
            shutil.rmtree(output, ignore_errors=True) if not output.endswith(".json") else Path(output).unlink(
                missing_ok=True)
    done = run_block(block)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not re.search("warn", done.stderr, re.I), done.stderr[-3000:]  # (torch's and transformers' kept out)
    assert all(Path(output).exists() for output in OUTPUTS if output in block)


@pytest.mark.slow
def test_the_readme_server_answers_its_client():
    """The serve block in the background, then the python block against it; SIGTERM ends the server."""
    server = subprocess.Popen(["bash", "-c", f"exec {SERVE.strip()}"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True).start()
    try:
        try:
            assert "serving demo at http://127.0.0.1:8000/v1" in lines.get(timeout=WAIT)
        except queue.Empty:
            raise AssertionError(f"the server did not start within {WAIT} s") from None
        (client,) = blocks("python")
        asked = subprocess.run([sys.executable, "-c", client], cwd=REPO, capture_output=True, text=True, timeout=WAIT)
        assert asked.returncode == 0 and asked.stdout.strip(), asked.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=WAIT)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
    assert server.returncode == 0 and "Traceback" not in server.stderr.read()


def test_the_docs_links_lead_to_files_that_exist():
    pages = [REPO / "README.md", *(REPO / "docs").glob("*.md")]
    broken = [(page.name, target) for page in pages
              for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text())
              if not (page.parent / target).exists()]
    assert not broken
