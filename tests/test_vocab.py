"""A drafter and a target whose checkpoints pad the vocabulary differently over one tokenizer (as
Qwen2.5-0.5B's 151936 rows and Qwen2.5-7B's 152064 do): the pair runs, padding rows are never
proposed, and greedy output stays the target's own."""

import json
import shutil

import pytest
import torch
from conftest import EMBEDDED
from helpers import chain_logits, hf_greedy, two_stage
from safetensors.torch import load_file, save_file

from specgraph.errors import CheckpointError
from specgraph.models.loader import load_model
from specgraph.program import Program

PADDED = 4160  # rows of a padded checkpoint; the tokenizer has 4096 tokens


def padded(checkpoint, folder, rows):
    """`checkpoint` (tied embeddings) with rows(embedding [V, hidden]) -> [R, hidden] appended to its
    embedding, in `folder`."""
    shutil.copytree(checkpoint, folder)
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        state = load_file(file)
        if "model.embed_tokens.weight" in state:
            embedding = state["model.embed_tokens.weight"]
            state["model.embed_tokens.weight"] = torch.cat([embedding, rows(embedding.float()).to(embedding.dtype)])
            save_file(state, file)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": PADDED}))
    return folder


@pytest.fixture(scope="module")
def greedy_draft(tmp_path_factory):
    """The embedded drafter padded with rows that outscore its real ones (ten times its first rows'
    embeddings): unmasked, it would propose padding ids."""
    return padded(EMBEDDED / "draft", tmp_path_factory.mktemp("vocab") / "draft", lambda e: 10 * e[: PADDED - 4096])


def test_a_padded_drafter_never_proposes_padding_and_output_stays_exact(greedy_draft, target_reference):
    raw = load_model(greedy_draft, torch.float32, "cpu")
    logits = chain_logits(raw, torch.tensor(target_reference[0][0]))
    assert (logits.argmax(-1) >= 4096).any()  # the oracle: without the mask, padding would be proposed

    program = Program.from_recipe(two_stage(EMBEDDED / "target", greedy_draft, {"shape": "dynamic", "width": 3,
                                                                                "depth": 3, "nodes": 8}))
    drafter = program.executor.runner.drafter
    proposed = []
    drafter.draft = _recording(drafter.draft, proposed)
    for ids, expected in target_reference[:3]:
        assert program.generate(ids, 64).output_ids == expected[:64]
    assert proposed and max(int(t.max()) for t in proposed) < 4096


def _recording(draft, proposed: list):
    def recording(*args, **kwargs):
        result = draft(*args, **kwargs)
        proposed.append(result.tree.tokens.clone())
        return result
    return recording


def test_a_padded_target_is_verified_over_its_whole_vocabulary(tmp_path, code_prompts):
    """The target's own padding rows stay: its greedy output is transformers' over all its rows;
    the drafter's logits are padded to the target's width. The sampling rule runs too."""
    target = padded(EMBEDDED / "target", tmp_path / "target", lambda e: torch.zeros(PADDED - 4096, e.shape[1]))
    expected = hf_greedy(target, code_prompts[:2], 48)
    program = Program.from_recipe(two_stage(target, EMBEDDED / "draft", {"shape": "static", "branching": [2, 2, 1]}))
    for ids, new in expected:
        assert program.generate(ids, 48).output_ids == new
    sampling = Program.from_recipe(two_stage(target, EMBEDDED / "draft", {"shape": "chain", "length": 3},
                                             sampling={"temperature": 0.8, "seed": 3}))
    ids = expected[0][0]
    first, again = sampling.generate(ids, 32, seed=5), sampling.generate(ids, 32, seed=5)
    assert first.output_ids == again.output_ids and len(first.output_ids) == 32


def test_different_vocabularies_without_tokenizers_are_refused(tmp_path, greedy_draft):
    bare = tmp_path / "bare"
    shutil.copytree(greedy_draft, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="vocab_size 4160 differs from models.target's 4096, and without a "
                                              "tokenizer.json"):
        Program.from_recipe(two_stage(EMBEDDED / "target", bare, {"shape": "chain", "length": 2}))
