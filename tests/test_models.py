"""Our Llama-family modules against transformers, on the fixtures and on tiny random checkpoints."""

import pytest
import torch
import transformers
from conftest import EMBEDDED, shared_model
from helpers import chain_logits

from specgraph.errors import CheckpointError
from specgraph.kernels import Kernels
from specgraph.models.loader import load_model
from specgraph.layout import physical
from specgraph.runtime.stage import Stage
from specgraph.tree import Tree

FP32_TOL = 1e-4  # max |logit difference| between our fp32 forward and transformers' fp32 forward


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits[0]  # [T, V]


def our_logits(model, ids):
    return chain_logits(model, ids[0])


@pytest.mark.parametrize("name", ["draft", "target", "mid"])
def test_fixture_logits_match_transformers(name):
    path = EMBEDDED / name if name != "mid" else shared_model("mid")
    ids = torch.randint(0, 4096, (1, 37))
    ours = our_logits(load_model(path, torch.float32, "cpu"), ids)
    assert (ours - hf_logits(path, ids)).abs().max() < FP32_TOL


def test_incremental_decoding_matches_one_pass():
    model = load_model(EMBEDDED / "target", torch.float32, "cpu")
    ids = torch.randint(0, 4096, (1, 20))
    full = our_logits(model, ids)
    stage = Stage("t", model, 32, torch.device("cpu"))
    one = torch.ones(1, 1, dtype=torch.bool)
    with torch.no_grad():
        steps = [stage.prefill(ids[0, :12])]  # then one token at a time, attending over all 32 slots
        steps += [stage.forward_one(ids[0, i:i + 1], torch.tensor([i]), torch.tensor(i), torch.tensor([0]), one, 32)
                  for i in range(12, 20)]
    assert (torch.cat(steps) - full).abs().max() < FP32_TOL


def test_tree_attention_equals_each_path_run_alone():
    """Every tree node's logits equal those of its root-to-node path appended to the prefix."""
    model = load_model(EMBEDDED / "target", torch.float32, "cpu")
    prefix = torch.randint(0, 4096, (1, 10))
    tree = Tree(tokens=torch.randint(0, 4096, (1, 7)), parents=torch.tensor([[-1, 0, 0, 1, 1, 2, 5]]))
    stage = Stage("t", model, 32, torch.device("cpu"))
    with torch.no_grad():
        stage.prefill(prefix[0])
        start = torch.tensor(10)
        logits = stage.forward_one(tree.tokens[0], 10 + tree.depths[0], start, torch.arange(7), tree.ancestors[0], 20)
    for node in range(tree.size):
        path = tree.ancestors[0, node].nonzero().flatten()
        alone = our_logits(model, torch.cat([prefix[0], tree.tokens[0, path]])[None])
        assert (logits[node] - alone[-1]).abs().max() < FP32_TOL


def test_commit_moves_the_accepted_path_into_the_prefix():
    model = load_model(EMBEDDED / "draft", torch.float32, "cpu")
    prefix = torch.randint(0, 4096, (1, 6))
    tree = Tree(tokens=torch.randint(0, 4096, (1, 5)), parents=torch.tensor([[-1, 0, 0, 2, 3]]))
    stage, fresh_stage = Stage("a", model, 16, torch.device("cpu")), Stage("b", model, 16, torch.device("cpu"))
    cache, fresh = stage.cache, fresh_stage.cache
    with torch.no_grad():
        stage.prefill(prefix[0])
        stage.forward_one(tree.tokens[0], 6 + tree.depths[0], torch.tensor(6), torch.arange(5), tree.ancestors[0], 16)
        cache.move(stage.table, torch.zeros(1, dtype=torch.long), 6 + torch.tensor([[0, 2, 3]]), 6 + torch.arange(3)[None])  # root, node 2, node 3
        fresh_stage.prefill(torch.cat([prefix[0], tree.tokens[0, [0, 2, 3]]]))
    slots = physical(stage.table, stage.block_size, 0, torch.arange(9))  # (both stages: row 0 over the same blocks)
    assert (cache.k[:, :, :, slots] - fresh.k[:, :, :, slots]).abs().max() < 1e-5
    assert (cache.v[:, :, :, slots] - fresh.v[:, :, :, slots]).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_tracks_fp32(dtype):
    ids = torch.randint(0, 4096, (1, 16))
    full = our_logits(load_model(EMBEDDED / "target", torch.float32, "cpu"), ids)
    half_model = load_model(EMBEDDED / "target", dtype, "cpu")
    assert half_model.lm_head.weight.dtype == dtype
    half = our_logits(half_model, ids)
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() > 0.8
    assert (half - full).abs().max() < 0.5


def tiny_config(arch: str):
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    if arch == "llama3":
        return transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "llama-bias":
        return transformers.LlamaConfig(**common, attention_bias=True, mlp_bias=True)
    cls = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    return cls(**common, head_dim=16) if arch == "qwen3" else cls(**common)


@pytest.mark.parametrize("arch", ["llama3", "llama-bias", "mistral", "qwen2", "qwen3"])
def test_other_architectures_match_transformers(arch, tmp_path):
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    for p in hf.parameters():  # random biases and norms so that every parameter matters
        p.data.normal_(0, 0.2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ids = torch.randint(0, 128, (1, 80))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    ours = load_model(tmp_path, torch.float32, "cpu")
    assert (our_logits(ours, ids) - ref).abs().max() < FP32_TOL
    if arch == "qwen3":  # its per-head q/k norms in the rotary kernel
        ours.use_kernels(Kernels.select({"rope_write": "triton"}))
        assert (our_logits(ours, ids) - ref).abs().max() < FP32_TOL


def test_weights_that_do_not_fit_the_layout_are_refused(tmp_path):
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2"))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = (tmp_path / "config.json").read_text().replace("Qwen2ForCausalLM", "LlamaForCausalLM")
    (tmp_path / "config.json").write_text(config.replace('"qwen2"', '"llama"'))
    with pytest.raises(CheckpointError, match="weights do not match the LlamaForCausalLM layout"):
        load_model(tmp_path, torch.float32, "cpu")
