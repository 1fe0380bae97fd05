"""Models named by Hugging Face hub id (org/name), found offline in a local cache laid out as the
hub lays it out (models--org--name: blobs, snapshots/COMMIT linking to them, refs/main naming the
commit) under a temporary HF_HOME: in a recipe, and as `specgraph serve MODEL --draft MODEL`."""

import hashlib
import json
import shutil
import signal
from pathlib import Path

import pytest
from conftest import EMBEDDED, REPO
from helpers import PROMPT

from specgraph.cli import main
from specgraph.program import Program
from specgraph.recipe import Recipe

DEMO = REPO / "recipes" / "demo.yaml"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(home: Path, repo_id: str, source: Path) -> None:
    """`source`'s files as the hub cache under `home` holds a download of `repo_id` at COMMIT."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in source.iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))


@pytest.fixture
def hub_home(tmp_path, monkeypatch):
    """A hub cache holding the embedded pair as acme/tiny-target and acme/tiny-draft, huggingface_hub
    pointed at it (and offline)."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    for name in ("target", "draft"):
        cache_model(home, f"acme/tiny-{name}", EMBEDDED / name)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))  # (read when huggingface_hub was imported)
    return home


def test_a_recipe_names_models_by_hub_id(hub_home, tmp_path):
    ids = ["--set", "models.target.path=acme/tiny-target", "--set", "models.draft.path=acme/tiny-draft"]
    recipe = Recipe.from_yaml(DEMO, ids[1::2])
    assert recipe.models["target"].path == hub_home / "hub" / "models--acme--tiny-target" / "snapshots" / COMMIT
    out = tmp_path / "out.json"
    assert main(["run", str(DEMO), *ids, "--prompt", PROMPT, "--max-new-tokens", "16", "--json", str(out)]) == 0
    program = Program.from_recipe(Recipe.from_yaml(DEMO))
    expected = program.generate(program.encode(PROMPT), 16).output_ids
    assert json.loads(out.read_text())["results"][0]["output_ids"] == expected


def test_a_hub_id_not_in_the_cache_names_the_cache(hub_home, capsys):
    assert main(["run", str(DEMO), "--set", "models.draft.path=acme/other", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"specgraph: error: models.draft.path: acme/other is neither a folder ({REPO / 'recipes'}/acme/other) "
                   f"nor a model in the Hugging Face cache ({hub_home / 'hub'}); download it there (hf download "
                   "acme/other), or give a checkpoint folder")
    assert main(["serve", "acme/other"]) == 2
    assert f"MODEL: acme/other is neither a recipe file, a checkpoint folder nor a model in the Hugging Face cache " \
           f"({hub_home / 'hub'})" in capsys.readouterr().err


@pytest.mark.parametrize("draft", [[], ["--draft", "acme/tiny-draft", "--set", "serving.speculation=always"]],
                         ids=["alone", "over-a-draft"])
def test_serve_model_by_hub_id_alone_or_over_a_draft(hub_home, tmp_path, draft):
    """`serve MODEL` decodes plainly; `serve MODEL --draft MODEL` speculates with the default chain;
    both named as given and answering with the target's own greedy tokens (the demo recipe's)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from test_server import WAIT, Served

    served = Served(["acme/tiny-target", *draft, "--set", "max_new_tokens=16"], tmp_path / "server.log")
    try:
        client = served.client()
        assert [m.id for m in client.models.list()] == ["acme/tiny-target"]
        text = client.completions.create(model="acme/tiny-target", prompt=PROMPT).choices[0].text
        families = text_string_to_metric_families(httpx.get(f"{served.url}/metrics", timeout=WAIT).text)
        modes = {sample.labels["mode"] for family in families if family.name == "specgraph_steps"
                 for sample in family.samples if sample.value > 0}
    finally:
        served.proc.send_signal(signal.SIGTERM)
        served.kill()
    program = Program.from_recipe(Recipe.from_yaml(DEMO))
    assert text == program.decode(program.generate(program.encode(PROMPT), 16).output_ids)
    assert modes == ({"ar"} if not draft else {"depth 4"})  # the default chain: 4 tokens


def test_speculative_model_is_vllms_name_for_draft():
    from specgraph.cli import build_parser

    parsed = build_parser().parse_args(["serve", "acme/tiny-target", "--speculative-model", "acme/tiny-draft"])
    assert parsed.draft == "acme/tiny-draft"


@pytest.mark.parametrize("args, words", [
    (["serve", str(EMBEDDED)], f"models.target.path: {EMBEDDED}: no config.json"),  # a folder, no checkpoint
    (["serve", str(DEMO), "--draft", str(EMBEDDED / "draft")], f"--draft: {DEMO} is a recipe"),
    (["run", str(REPO / "recipes")], f"recipe: {REPO / 'recipes'} is a folder; a recipe is a YAML file"),
    (["run", str(DEMO), "--set", f"models.draft.path={DEMO}"], f"{DEMO} is a file; a checkpoint is a folder"),
    (["run", str(DEMO), "--prompts", str(REPO / "recipes")], f"--prompts: {REPO / 'recipes'} is a folder; give a file"),
])
def test_a_folder_where_a_file_is_meant_and_the_reverse_say_which(args, words, capsys):
    assert main(args) == 2
    assert words in capsys.readouterr().err.strip().splitlines()[-1]
