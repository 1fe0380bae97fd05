"""EAGLE-3 heads (models/eagle.py, head.py, train_head.py): a head in the published layout, built
here from its documented names and shapes, loads and drafts what EAGLE-3 computes (a plain PyTorch
reading of those tensors over transformers' hidden states); greedy decoding with a head equals
transformers' greedy decoding of the target; `train-draft` writes a head that does the same, and
resumes exactly; heads and training data we do not support are refused in one line."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
import transformers
from conftest import EMBEDDED, REPO
from helpers import (BUDGETS, REDUCED, decode_together, law, seeded_generations, total_variation, two_stage,
                     two_token_law)
from safetensors.torch import load_file, save_file

from specgraph.models.widen import HEAD_DRAFT_VOCAB, widen
from specgraph.cli import main
from specgraph.errors import SpecgraphError
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.recipe import Recipe

TARGET = EMBEDDED / "target"
SHIPPED = EMBEDDED / "eagle3"  # the head shipped for the target fixture (recipes/eagle3.yaml)
TREES = {
    "chain": {"shape": "chain", "length": 4},
    "static": {"shape": "static", "branching": [3, 2, 1, 1]},
    "dynamic": {"shape": "dynamic", "width": 4, "depth": 5, "nodes": 24},
}
H, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 384, 3, 1, 128, 1024, 4096  # the target fixture's shape


def published_head(folder: Path, draft_vocab: int = 1024, seed: int = 0, **config) -> Path:
    """An EAGLE-3 head for the target fixture in the published layout (random weights): config.json
    naming LlamaForCausalLMEagle3, fc [H, 3H], one midlayer whose q/k/v read 2H, norm, a reduced
    lm_head [draft_vocab, H], d2t (draft id -> target id offset) and t2d; no embed_tokens (the target's)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    state = {"fc.weight": rand(H, 3 * H), "norm.weight": 1 + 0.1 * rand(H), "lm_head.weight": 4 * rand(draft_vocab, H)}
    layer = {"hidden_norm.weight": 1 + 0.1 * rand(H), "input_layernorm.weight": 1 + 0.1 * rand(H),
             "post_attention_layernorm.weight": 1 + 0.1 * rand(H),
             "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * H), "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * H),
             "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * H), "self_attn.o_proj.weight": rand(H, HEADS * HEAD_DIM),
             "mlp.gate_proj.weight": rand(FFN, H), "mlp.up_proj.weight": rand(FFN, H), "mlp.down_proj.weight": rand(H, FFN)}
    state |= {f"midlayer.{name}": tensor for name, tensor in layer.items()}
    ids = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values  # the target ids the head covers
    state["d2t"] = ids - torch.arange(draft_vocab)
    state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True)
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H, "intermediate_size": FFN,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "draft_vocab_size": draft_vocab, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 0,
        "eos_token_id": 0} | config))
    return folder


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d] rotated as Llama's rotary embedding (theta 500000) at `positions` [n]."""
    d = x.shape[-1]
    freqs = positions[:, None].float() / 500000.0 ** (torch.arange(0, d, 2).float() / d)  # [n, d/2]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def eagle3_chain(head: Path, ids: list[int], length: int) -> list[int]:
    """EAGLE-3's greedy chain of `length` drafts after `ids`, read off the published tensors in plain
    PyTorch: pairs (the target's layer-2, 4 and 5 inputs at token p — transformers' hidden states —
    fused by fc, token p + 1) at positions p through the midlayer with full causal attention, each
    draft fed back as (the midlayer's output, its token)."""
    w = {name: t.float() if t.is_floating_point() else t for name, t in load_file(head / "model.safetensors").items()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # input of layer i: states[i]
        hidden = torch.cat([states[i][0] for i in (2, 4, 5)], -1)[:-1] @ w["fc.weight"].T  # [n, H]
        tokens, chain = list(ids[1:]), []
        embed = hf.model.embed_tokens.weight
        for _ in range(length):
            n = len(tokens)
            x = torch.cat([_rms(embed[tokens], w["midlayer.input_layernorm.weight"]),
                           _rms(hidden, w["midlayer.hidden_norm.weight"])], -1)  # [n, 2H]
            q = _rotate((x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, HEADS, HEAD_DIM), torch.arange(n))
            k = _rotate((x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM), torch.arange(n))
            v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
            scores = torch.einsum("qhd,khd->hqk", q, k.expand(n, HEADS, HEAD_DIM)) / math.sqrt(HEAD_DIM)
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.expand(n, HEADS, HEAD_DIM)).reshape(n, -1)
            r = hidden + attended @ w["midlayer.self_attn.o_proj.weight"].T
            m = _rms(r, w["midlayer.post_attention_layernorm.weight"])
            out = r + (torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T)
                       * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
            draft = int((_rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
            token = draft + int(w["d2t"][draft])
            chain.append(token)
            tokens.append(token)
            hidden = torch.cat([hidden, out[-1:]])
    return chain


def drafted_chains(program: Program, ids: list[int], steps: int) -> list[tuple[list[int], list[int]]]:
    """Each of the first `steps` steps of the engine on `ids`: (what was committed before it, its drafted chain)."""
    engine = program.executor
    runner, chains = engine.runner, []
    draft = runner.drafter.draft

    def noting(requests, *args, **kwargs):
        drafted = draft(requests, *args, **kwargs)
        length = int(requests.lengths[0])
        chains.append((requests.tokens[requests.rows[0], :length].tolist(), drafted.tree.tokens[0, 1:].tolist()))
        return drafted

    runner.drafter.draft = noting
    request = engine.add_request(ids, 64)
    while len(chains) < steps and not request.finished:
        engine.step()
    return chains


@pytest.fixture(scope="module")
def head(tmp_path_factory) -> Path:
    return published_head(tmp_path_factory.mktemp("eagle3") / "head")


def test_a_published_head_drafts_what_eagle3_computes(head):
    program = Program.from_recipe(two_stage(TARGET, head, {"shape": "chain", "length": 3}))
    ids = program.encode("import os\nimport sys\n\n\ndef main(argv):\n")
    chains = drafted_chains(program, ids, 3)
    assert len(chains) == 3
    for committed, chain in chains:
        assert chain == eagle3_chain(head, committed, 3)


@pytest.mark.parametrize("shape", list(TREES))
def test_greedy_output_with_a_published_head_equals_the_target_alone(target_reference, head, shape):
    program = Program.from_recipe(two_stage(TARGET, head, TREES[shape], max_new_tokens=48))
    ids, expected = target_reference[0]
    assert program.generate(ids).output_ids == expected[:48]


def refusal(recipe: Recipe) -> str:
    with pytest.raises(SpecgraphError) as caught:
        Program.from_recipe(recipe)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_heads_we_do_not_support_are_refused_in_one_line(tmp_path, head):
    older = published_head(tmp_path / "eagle1", architectures=["LlamaForCausalLMEagle"])
    assert "EAGLE-1/2 head, which is not supported" in refusal(two_stage(TARGET, older, TREES["chain"]))
    layers = published_head(tmp_path / "layers", num_hidden_layers=2)
    assert "one decoder layer" in refusal(two_stage(TARGET, layers, TREES["chain"]))
    wide = published_head(tmp_path / "wide", vocab_size=8192)
    assert "the head is for a target of vocab_size 8192" in refusal(two_stage(TARGET, wide, TREES["chain"]))
    deep = published_head(tmp_path / "deep", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 9]})
    assert "reads target layers [1, 4, 9]" in refusal(two_stage(TARGET, deep, TREES["chain"]))
    unfused = published_head(tmp_path / "unfused")
    state = load_file(unfused / "model.safetensors")
    save_file({k: v for k, v in state.items() if k != "fc.weight"}, unfused / "model.safetensors")
    assert "missing fc.weight" in refusal(two_stage(TARGET, unfused, TREES["chain"]))
    scattered = published_head(tmp_path / "scattered")
    state = load_file(scattered / "model.safetensors")
    save_file(state | {"d2t": state["d2t"] + VOCAB}, scattered / "model.safetensors")
    assert "d2t maps draft ids outside the target's vocabulary" in refusal(two_stage(TARGET, scattered, TREES["chain"]))
    assert "it cannot be the target" in refusal(two_stage(head, None))
    recipe = two_stage(TARGET, head, TREES["dynamic"]).model_copy(update={"execution": "disaggregated"})
    assert "drafts static trees under execution: disaggregated (drafted anew from each verdict's features; got a " \
        "dynamic tree)" in refusal(recipe)
    recipe = two_stage(TARGET, head, TREES["chain"]).model_copy(update={"execution": "pipeline"})
    assert "drafts under execution: serial or disaggregated (got pipeline)" in refusal(recipe)
    mixed = two_stage(TARGET, head, TREES["chain"])
    mixed = mixed.model_copy(update={"models": {**mixed.models, "draft": mixed.models["draft"].model_copy(
        update={"dtype": "bfloat16"})}})
    assert "which runs in its target's dtype: give models.draft.dtype 'float32' (got 'bfloat16')" in refusal(mixed)
    apart = two_stage(TARGET, head, TREES["chain"])
    apart = apart.model_copy(update={"stages": [apart.stages[0].model_copy(update={"devices": ["cuda:1"]}),
                                                apart.stages[1]]})
    assert "drafts beside its target in serial execution: give it the target's one device (['cpu'])" in refusal(apart)


def test_a_head_recipe_is_not_exported_in_one_line(tmp_path, capsys, head):
    recipe = tmp_path / "r.yaml"
    recipe.write_text((REPO / "recipes" / "eagle3.yaml").read_text().replace("models/target", str(TARGET))
                      .replace("models/eagle3", str(head)))
    assert main(["compile", str(recipe), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == ("specgraph: error: compile: stage draft drafts with an EAGLE-3 head, "
                                               "which cannot be exported yet; run the recipe itself (specgraph run RECIPE)")


def training_data(path: Path) -> Path:
    """Training texts for the tests' heads: this repository's own sources (not the held-out prompts)."""
    path.write_text("".join(json.dumps({"text": f.read_text()}) + "\n" for f in sorted((REPO / "specgraph").glob("*.py"))))
    return path


def train_draft(data: Path, out: Path, *flags: str) -> int:
    return main(["train-draft", str(TARGET), "--data", str(data), "-o", str(out), "--batch", "4", "--seq-len", "64",
                 "--ttt", "3", "--draft-vocab", "512", "--intermediate-size", "256", *flags])


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trained")
    assert train_draft(training_data(folder / "data.jsonl"), folder / "head", "--steps", "40", "--lr", "3e-3") == 0
    return folder / "head"


def test_train_draft_writes_the_published_layout(trained):
    names = set(load_file(trained / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names and "embed_tokens.weight" not in names
    config = json.loads((trained / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 512
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


@pytest.mark.parametrize("shape", list(TREES))
def test_a_trained_head_decodes_as_the_target_alone(target_reference, trained, shape):
    program = Program.from_recipe(two_stage(TARGET, trained, TREES[shape], max_new_tokens=48))
    for ids, expected in target_reference[:2]:
        assert program.generate(ids).output_ids == expected[:48]


def test_a_resumed_run_ends_where_one_run_does(tmp_path):
    """Bitwise, so every part runs on one thread: the default thread count follows the machine's load,
    and a CPU matmul's sums are split (and rounded) by thread."""
    data = training_data(tmp_path / "data.jsonl")
    assert train_draft(data, tmp_path / "whole", "--steps", "6", "--threads", "1") == 0
    assert train_draft(data, tmp_path / "parts", "--steps", "3", "--threads", "1") == 0
    assert json.loads((tmp_path / "parts" / "training" / "state.json").read_text())["step"] == 3
    assert train_draft(data, tmp_path / "parts", "--steps", "6", "--threads", "1") == 0
    whole, parts = (load_file(tmp_path / run / "model.safetensors") for run in ("whole", "parts"))
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)


def test_train_draft_refuses_bad_data_and_targets_in_one_line(tmp_path, capsys, head):
    data = training_data(tmp_path / "data.jsonl")
    cases = [
        (tmp_path / "none.jsonl", [], "does not exist"),
        (tmp_path / "bad.jsonl", [], "line 2 is not JSON"),
        (tmp_path / "field.jsonl", [], "line 1 needs a 'text' (or 'prompt') string"),
        (tmp_path / "short.jsonl", [], "training windows need more than 64"),
        (data, ["--layers", "1,2,9"], "--layers: three layers of the target's 8"),
        (data, ["--layers", "a,b"], "--layers: three layer indices"),
        (data, ["--ttt", "63"], "--ttt: at most --seq-len - 2 rounds (62)"),
        (data, ["--device", "gpu0"], "--device: 'gpu0' is not a device; valid: cpu, cuda, cuda:N"),
        (data, ["--decay-steps", "0"], "--decay-steps: must be at least 1"),
    ]
    (tmp_path / "bad.jsonl").write_text('{"text": "x = 1"}\nnot json\n')
    (tmp_path / "field.jsonl").write_text('{"code": "x = 1"}\n')
    (tmp_path / "short.jsonl").write_text('{"prompt": "x = 1"}\n')
    for file, flags, message in cases:
        assert train_draft(file, tmp_path / "out", "--steps", "1", *flags) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err
    assert main(["train-draft", str(head), "--data", str(data), "-o", str(tmp_path / "out")]) == 2
    assert "train-draft trains heads for Llama-family targets, not LlamaForCausalLMEagle3" in capsys.readouterr().err
    assert train_draft(data, tmp_path / "out", "--steps", "1") == 0
    capsys.readouterr()
    assert train_draft(data, tmp_path / "out", "--steps", "2", "--lr", "0.5") == 2
    assert "holds a run with other settings (lr)" in capsys.readouterr().err


def test_the_learning_rate_warms_up_then_follows_the_cosine(tmp_path):
    """--decay-steps N: linear warm-up over min(100, steps / 10) steps, then lr (0.1 + 0.9 (1 + cos(pi t)) / 2),
    t going from 0 at the warm-up's end to 1 at step N, and a tenth of lr after it."""
    from specgraph.train_head import Trainer, TrainSpec

    spec = TrainSpec(TARGET, training_data(tmp_path / "data.jsonl"), tmp_path / "out", steps=1000, lr=2e-3, batch=2,
                     seq_len=32, draft_vocab=512, intermediate_size=64, decay_steps=600)
    trainer = Trainer(spec)
    expected = {0: 2e-3 / 100, 49: 2e-3 / 2, 99: 2e-3, 100: 2e-3, 350: 2e-3 * 0.55, 600: 2e-4, 900: 2e-4}
    for step, rate in expected.items():
        trainer.step = step
        assert trainer.rate() == pytest.approx(rate, rel=1e-9), step


def test_train_draft_starts_from_a_head_and_reports_its_rate_and_coverage(tmp_path, capsys, trained):
    """--init HEAD: the run starts from HEAD's weights and vocabulary (one step at a negligible rate
    leaves them); the last line reports tokens/s and the vocabulary's coverage of the target's
    choices; --init of a model that is no head is refused in one line."""
    data = training_data(tmp_path / "data.jsonl")
    capsys.readouterr()
    assert main(["train-draft", str(TARGET), "--data", str(data), "-o", str(tmp_path / "out"), "--batch", "2",
                 "--seq-len", "32", "--steps", "1", "--lr", "1e-12", "--init", str(trained)]) == 0
    report = capsys.readouterr().out.splitlines()[-2]
    assert re.fullmatch(r"trained steps 1-1: 64 tokens in \d+ s, \d+ tokens/s; the draft vocabulary \(512 ids\) "
                        r"covers \d+\.\d% of the target's next tokens on the data", report), report
    before, after = load_file(trained / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.allclose(before[k].float(), after[k].float(), atol=1e-6) for k in before)
    assert main(["train-draft", str(TARGET), "--data", str(data), "-o", str(tmp_path / "bad"), "--init", str(TARGET)]) == 2
    assert capsys.readouterr().err.strip() == (f"specgraph: error: --init: {TARGET} is not an EAGLE-3 head "
                                               "(LlamaForCausalLM)")


@pytest.mark.parametrize("shape", list(TREES))
def test_the_shipped_head_decodes_as_the_target_alone(target_reference, shape):
    program = Program.from_recipe(two_stage(TARGET, SHIPPED, TREES[shape], max_new_tokens=128))
    accepted = []
    for ids, expected in target_reference[:4]:
        generation = program.generate(ids)
        assert generation.output_ids == expected
        accepted += generation.accepted_lengths
    assert sum(accepted) / len(accepted) > 1.5  # the head's drafts are really being accepted


@pytest.mark.parametrize("bucketed", [False, True], ids=["prompt", "bucketed-prompt"])
def test_the_shipped_head_drafts_what_eagle3_computes_across_steps(bucketed):
    """Steps that commit several tokens: the catch-up feeds all their pairs. `bucketed`: the prompt's
    pairs fed in a forward padded as a GPU's captured prompt forwards are (runner.prompt_bucket)."""
    program = Program.from_recipe(two_stage(TARGET, SHIPPED, {"shape": "chain", "length": 3}))
    program.executor.runner.captured = bucketed
    chains = drafted_chains(program, program.encode("import os\nimport sys\n\n\ndef main(argv):\n"), 6)
    committed = [len(before) for before, _ in chains]
    assert max(b - a for a, b in zip(committed, committed[1:])) > 1
    for before, chain in chains:
        assert chain == eagle3_chain(SHIPPED, before, 3)


def test_the_eagle3_recipe_decodes_as_the_target_alone(target_reference):
    program = Program.from_recipe(Recipe.from_yaml(REPO / "recipes" / "eagle3.yaml", ["max_new_tokens=128"]))
    ids, expected = target_reference[1]
    assert program.generate(ids).output_ids == expected


def test_sampling_through_the_head_follows_the_target_distribution():
    """Two sampled tokens after a prompt, many seeds, the head drawing its children (a static tree):
    their empirical joint approaches the target's exact one (temperature 1, top-k 3: 9 outcomes)."""
    sampling = {"temperature": 1.0, "top_k": 3}
    program = Program.from_recipe(two_stage(TARGET, SHIPPED, {"shape": "static", "branching": [2, 1]},
                                            sampling=sampling, max_new_tokens=2, serving={"max_batch": 16}))
    ids = program.encode("import os\n\n\ndef main(argv):\n    for i in range(")  # (the head's first draft is often accepted)
    generations = seeded_generations(program, ids, 1200)
    observed, first_steps = law(g.output_ids for g in generations), [g.accepted_lengths[0] for g in generations]
    exact = two_token_law(TARGET, ids, sampling)
    assert set(observed) <= set(exact)  # nothing outside the target's support
    assert first_steps.count(2) > 300  # the head's drafts are accepted, often
    assert total_variation(observed, exact) < 0.06  # (the expected distance at 1200 draws is about 0.03)


def test_a_widened_head_drafts_as_the_small_one(target_reference):
    """`--widen` takes a head to a head of the target's shape (models/widen.py): at an 8B-like layout
    (REDUCED) its drafts, so its accepted lengths, are the small head's, step for step, and both
    decode transformers' greedy tokens of the target (128 of them, past a few near-ties)."""
    graph = plan(two_stage(TARGET, SHIPPED, TREES["dynamic"], max_new_tokens=128))
    small = Program(graph)
    models = {name: widen(small.stages[name].model, REDUCED, "cpu", torch.float32) for name in ("target", "draft")}
    head = models["draft"]
    assert head.fc.weight.shape == (640, 3 * 640) and head.lm_head.weight.shape == (HEAD_DRAFT_VOCAB, 640)
    assert head.layers[0].mlp.down_proj.weight.shape == (640, REDUCED.intermediate_size)
    wide = Program(graph, models)
    ids, expected = target_reference[0]
    a, b = small.generate(ids), wide.generate(ids)
    assert b.output_ids == a.output_ids == expected
    assert b.accepted_lengths == a.accepted_lengths and sum(a.accepted_lengths) > 1.5 * len(a.accepted_lengths)


@pytest.mark.parametrize("budget, bucketed", [(None, False), ({1: 6, 2: 8, 4: 12, 5: 14}, False), (None, True)],
                         ids=["own-trees", "budget", "bucketed-prompts"])
def test_the_head_drafts_for_five_requests_at_a_time(target_reference, budget, bucketed):
    """The engine with a head: requests of mixed lengths, five at a time with staggered finishes,
    each with its own pending features, under each tree's nodes or a batch-wide budget. `bucketed`:
    prompt chunks packed as a GPU's captured forwards pack them (padded to powers of two, the added
    chunks empty ones of the padding row), the head fed every chunk's pairs in the same forward."""
    target = {"name": "target", "model": "target", "devices": ["cpu"], "verifies": "draft"}
    if budget:
        target["verify"] = {"budget": {"epsilon": 0.1, "nodes": budget}}
    recipe = Recipe.from_dict({
        "name": "batched", "serving": {"max_batch": 5, "block_size": 16},
        "models": {"target": {"path": str(TARGET)}, "draft": {"path": str(SHIPPED)}},
        "stages": [{"name": "draft", "model": "draft", "devices": ["cpu"],
                    "tree": {"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}}, target]})
    program = Program.from_recipe(recipe)
    program.executor.runner.captured = bucketed
    outputs = decode_together(program, target_reference)
    assert outputs == [expected[:n] for (_, expected), n in zip(target_reference, BUDGETS)]


def test_the_head_drafts_in_a_process_of_its_own(target_reference):
    """The disaggregated executor with a head: the target sends the prompt's features after its
    prefill and each verdict's accepted path's with it; the head, in its own process (with the
    target's embedding read from the target's checkpoint), drafts static trees from them."""
    recipe = two_stage(TARGET, SHIPPED, TREES["static"], max_new_tokens=128, execution="disaggregated")
    accepted = []
    with Program.from_recipe(recipe) as program:
        for ids, expected in target_reference[:4]:
            generation = program.generate(ids)
            assert generation.output_ids == expected
            accepted += generation.accepted_lengths
        one = target_reference[0][0][:1]  # a one-token prompt: no features before the first verdict
        alone = Program.from_recipe(two_stage(TARGET, None, max_new_tokens=24))
        assert program.generate(one, 24).output_ids == alone.generate(one).output_ids
    assert max(len(ids) for ids, _ in target_reference[:4]) > 64  # (prompts of several feature messages)
    assert sum(accepted) / len(accepted) > 1.5  # the head's drafts are really being accepted


def test_head_data_writes_the_targets_continuations_and_keeps_the_validation_split_out(tmp_path, capsys):
    """`python3 -m specgraph.head_data`: batched, left-padded, the target's greedy continuations are
    transformers' unbatched greedy ones; a validation text gives only its opening to VAL; a run cut
    short resumes to the same file."""
    from helpers import hf_greedy

    from specgraph.head_data import cut, is_validation, main as head_data
    from specgraph.text import Tokenizer

    sources = sorted((REPO / "specgraph").glob("*.py"), key=lambda f: f.name)
    texts = [f.read_text() for f in sources]
    held = next(t for t in (f.read_text() for f in sorted((REPO / "specgraph").rglob("*.py"))) if is_validation(t)
                and len(Tokenizer(TARGET).encode(t)) >= 64)
    data = tmp_path / "split.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in [held, *texts]))
    args = ["--data", str(data), "--val", str(tmp_path / "val.jsonl"), "--prompts", "5", "--prompt-tokens", "32",
            "--new-tokens", "12", "--temperatures", "0", "--batch", "2"]
    assert head_data([str(TARGET), "-o", str(tmp_path / "whole.jsonl"), *args]) == 0
    written = [json.loads(line)["text"] for line in (tmp_path / "whole.jsonl").read_text().splitlines()]
    prompts, val = cut([held, *texts], Tokenizer(TARGET), 32, 2)
    assert len(written) == 5 and val[0] == Tokenizer(TARGET).encode(held)[:32]
    assert [json.loads(line)["prompt"] for line in (tmp_path / "val.jsonl").read_text().splitlines()][0] == \
        Tokenizer(TARGET).decode(val[0])
    expected = hf_greedy(TARGET, [{"prompt": Tokenizer(TARGET).decode(p)} for p in prompts[:5]], 12)
    assert written == [Tokenizer(TARGET).decode(ids + new) for ids, new in expected]
    assert not any(held[:200] in text for text in written)
    lines = (tmp_path / "whole.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "parts.jsonl").write_text("".join(lines[:2]))  # a run stopped after its first batch
    assert head_data([str(TARGET), "-o", str(tmp_path / "parts.jsonl"), *args]) == 0
    assert (tmp_path / "parts.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    capsys.readouterr()
    assert head_data([str(TARGET), "-o", str(tmp_path / "x.jsonl"), *args[:-4], "--temperatures", "hot"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "head_data: error: --temperatures: numbers, as 0,0.7 (got 'hot')"
