"""Quantized checkpoints: compressed-tensors (written by the library itself), AutoAWQ's GEMM and GPTQ
formats (built here with their documented packing) decode through specgraph as transformers decodes
them, as target and as drafter; damaged or unsupported quantized checkpoints refused in one line.
(The quantized projection kernels against their reference: tests/test_kernels.py.)"""

import contextlib
import functools
import json
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
from conftest import EMBEDDED, REPO, absent, shared_model
from helpers import (REDUCED, as_vision_language, hf_continuation, hf_greedy, law, seeded_generations,
                     simulated_distances, total_variation, two_stage, two_token_law)
from safetensors.torch import load_file, save_file

from specgraph.models.widen import widen
from specgraph.cli import main
from specgraph.errors import CheckpointError, RecipeError, SpecgraphError
from specgraph.models.loader import load_model, safetensor_files
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.quant.linear import QuantLinear
from specgraph.quant.quantize import quantize_linear
from specgraph.recipe import Recipe

TARGET, DRAFT = EMBEDDED / "target", EMBEDDED / "draft"
PROMPTS = [{"prompt": "import os\nimport sys\n\n\ndef main(argv):\n"},
           {"prompt": "class Tree:\n    \"\"\"A rooted tree.\"\"\"\n\n    def __init__(self"}]
NEW = 40
CHAIN, DYNAMIC = {"shape": "chain", "length": 3}, {"shape": "dynamic", "width": 3, "depth": 3, "nodes": 8}


def write_compressed_tensors(source, folder, scheme: str):
    """`source` quantized by round to nearest and saved by compressed-tensors itself (its
    qparams, its compressor, its config): `scheme` int4-sym (group 32), int4-asym (group 64),
    int8-channel or fp8 (per channel); lm_head left in full precision."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    args = {"int4-sym": QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
            "int4-asym": QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64),
            "int8-channel": QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
            "fp8": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")}[scheme]
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            w = w.view(w.shape[0], -1, args.group_size) if args.strategy == "group" else w[:, None]
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(folder)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / file, folder / file)
    return folder


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed")
    return {scheme: write_compressed_tensors(TARGET, root / scheme, scheme)
            for scheme in ("int4-sym", "int4-asym", "int8-channel", "fp8")}


@functools.cache
def plain_greedy() -> list[list[int]]:
    """transformers' greedy continuations of PROMPTS by the plain target."""
    return [new for _, new in hf_greedy(TARGET, PROMPTS, NEW)]


def ours(target, draft=None, tree=None, **fields) -> list[list[int]]:
    program = Program.from_recipe(two_stage(target, draft, tree, max_new_tokens=NEW, **fields))
    return [program.generate(program.encode(row["prompt"])).output_ids for row in PROMPTS]


@pytest.mark.parametrize("scheme", ["int4-sym", "int4-asym", "int8-channel", "fp8"])
def test_a_compressed_tensors_target_decodes_as_transformers_decodes_it(compressed, scheme):
    checkpoint = compressed[scheme]
    expected = [new for _, new in hf_greedy(checkpoint, PROMPTS, NEW)]
    if scheme != "int8-channel":  # (int8 rarely changes a greedy token of these)
        assert expected != plain_greedy()  # the quantization changes what the target says: the test can tell
    assert ours(checkpoint) == expected
    assert ours(checkpoint, DRAFT, DYNAMIC) == expected


def test_a_compressed_tensors_drafter_keeps_the_plain_target_exact(compressed):
    expected = plain_greedy()
    assert ours(TARGET, compressed["int4-asym"], CHAIN) == expected
    assert ours(TARGET, compressed["fp8"], DYNAMIC) == expected


def test_sampling_through_a_quantized_target_follows_its_distribution(compressed):
    """Two sampled tokens, many seeds, the int4 target verifying the plain drafter's static tree:
    their empirical joint approaches the quantized target's exact one, and a sampler that ignored
    the quantization (the plain target's law, 0.36 away in total variation) would fail the same bound."""
    target, sampling, draws = compressed["int4-sym"], {"temperature": 1.0, "top_k": 3}, 800
    program = Program.from_recipe(two_stage(target, DRAFT, {"shape": "static", "branching": [2, 1]},
                                            sampling=sampling, max_new_tokens=2, serving={"max_batch": 16}))
    ids = program.encode("import os\n\n\ndef main(argv):\n    if ")  # (the draft's first token: accepted one time in four)
    observed = law(g.output_ids for g in seeded_generations(program, ids, draws))
    exact, plain = two_token_law(target, ids, sampling), two_token_law(TARGET, ids, sampling)
    # The bound (helpers.simulated_distances): the distance that 800 draws of the exact law exceed once in 10,000
    # simulated runs (about 0.08)
    bound = float(simulated_distances(exact, draws).quantile(0.9999))
    assert set(observed) <= set(exact)
    assert total_variation(observed, exact) < bound
    assert simulated_distances(plain, draws, to=exact).min() > bound  # power: 800 draws of the plain law always fail it


# -- AutoAWQ (GEMM) and GPTQ: packed here as their formats document, against a plain checkpoint of the same weights

def rtn(w: torch.Tensor, group: int, symmetric: bool, bits: int = 4):
    """Round-to-nearest unsigned codes [N, K], zero points and scales [N, K / group] of w [N, K]."""
    g, top = w.view(w.shape[0], -1, group), (1 << bits) - 1
    if symmetric:
        scale = g.abs().amax(-1) / (top / 2)
        zero = torch.full_like(scale, 1 << (bits - 1))
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / top
        zero = (-lo / scale).round().clamp(0, top)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, top)
    return q.flatten(1).to(torch.int64), zero.to(torch.int64), scale


def words_along_last(values: torch.Tensor, bits: int = 4, order=None) -> torch.Tensor:
    """Unsigned values [R, C] -> int32 [R, C / (32 / bits)]: the value of column p c + order[i] in bits
    `bits` i of word c (p = 32 / bits values a word; order: 0, 1, ... unless given)."""
    p = 32 // bits
    r, c = values.shape
    v = values.view(r, c // p, p)
    word = sum(v[..., j] << (bits * i) for i, j in enumerate(order or range(p)))
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def dequantized(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weights [N, K] that codes q [N, K], zero points and scales [N, K / group] stand for."""
    group = q.shape[1] // zero.shape[1]
    return ((q - zero.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)).contiguous()


def awq_tensors(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout (4 bits): qweight [K, N/8] and qzeros [K/G, N/8], the columns of each word in
    AWQ's order 0 2 4 6 1 3 5 7; scales [K/G, N]."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return {"qweight": words_along_last(q.t().contiguous(), 4, order),
            "qzeros": words_along_last(zero.t().contiguous(), 4, order), "scales": scale.t().contiguous()}


def gptq_tensors(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int,
                 checkpoint_format: str) -> dict[str, torch.Tensor]:
    """GPTQ's layout: qweight [K/p, N] packed along K, qzeros [K/G, N/p] (in the original format "gptq"
    each stored less one), scales [K/G, N], g_idx [K] (the group of each input, in order: no act order)."""
    stored = zero - 1 if checkpoint_format == "gptq" else zero
    group = q.shape[1] // zero.shape[1]
    return {"qweight": words_along_last(q, bits).t().contiguous(),
            "qzeros": words_along_last(stored.t().contiguous(), bits), "scales": scale.t().contiguous(),
            "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // group}


# method -> (bits, symmetric, config): AutoAWQ GEMM; GPTQ sym (zeros stored less one), asymmetric in
# gptq_v2 (stored as they are), 8 bits
LAYOUTS = {"awq": (4, False, {"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemm"}),
           "gptq": (4, True, {"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": True,
                              "checkpoint_format": "gptq"}),
           "gptq-v2-asym": (4, False, {"quant_method": "gptq", "bits": 4, "desc_act": False, "sym": False,
                                       "checkpoint_format": "gptq_v2"}),
           "gptq-8bit": (8, False, {"quant_method": "gptq", "bits": 8, "desc_act": False, "sym": False,
                                    "checkpoint_format": "gptq"})}


def quantized_pair(tmp_path, method: str):
    """(a checkpoint of the target in `method`'s layout (LAYOUTS), a plain checkpoint of the weights it stands for)."""
    bits, symmetric, quantization = LAYOUTS[method]
    state = {k: v for file in safetensor_files(TARGET) for k, v in load_file(file).items()}
    plain, packed, group = dict(state), dict(state), 32
    for name in [n for n in state if n.endswith("_proj.weight")]:
        stem, w = name.removesuffix(".weight"), state[name].float()
        q, zero, scale = rtn(w, group, symmetric, bits)
        plain[name] = dequantized(q, zero, scale)
        del packed[name]
        tensors = (awq_tensors(q, zero, scale) if method == "awq" else
                   gptq_tensors(q, zero, scale, bits, quantization["checkpoint_format"]))
        packed.update({f"{stem}.{key}": value for key, value in tensors.items()})
    config = json.loads((TARGET / "config.json").read_text())
    folders = []
    for kind, tensors, extra in (("packed", packed, {"quantization_config": quantization | {"group_size": group}}),
                                 ("plain", plain, {})):
        folder = tmp_path / f"{method}-{kind}"
        folder.mkdir()
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TARGET / file, folder / file)
        (folder / "config.json").write_text(json.dumps(config | extra))
        save_file(tensors, folder / "model.safetensors")
        folders.append(folder)
    return folders


@pytest.mark.parametrize("method", list(LAYOUTS))
def test_awq_and_gptq_checkpoints_decode_as_their_weights_do(tmp_path, method):
    packed, plain = quantized_pair(tmp_path, method)
    expected = [new for _, new in hf_greedy(plain, PROMPTS, NEW)]
    if method != "gptq-8bit":  # (8 bits rarely change a greedy token of these)
        assert expected != plain_greedy()
    assert ours(packed) == expected
    assert ours(packed, DRAFT, CHAIN) == expected
    assert ours(TARGET, packed, DYNAMIC) == plain_greedy()  # as drafter


def test_awq_tensors_are_what_autoawqs_packer_writes():
    """awq_tensors, written from AutoAWQ's description of its GEMM layout, against AutoAWQ's own packer
    (WQLinear_GEMM.from_linear) given the same codes: the same words.
    GPTQ's layouts have no such check: no GPTQ packer installs on this CPU beside torch 2.13 and
    transformers 5.17. transformers loads GPTQ (and AWQ) checkpoints only through gptqmodel, whose
    7.7.0 needs torch >= 2.14.1 and transformers >= 5.20.2; its 7.3.6 installs (no build), but pins
    numpy==2.2.6 (2.4.6 here) and cannot be imported without torchvision, which it does not declare and
    whose install from PyPI replaced torch by a 5.7 GB CUDA build (2.14.1). auto-gptq 0.7.1 installs
    but fails to import: "cannot import name 'no_init_weights' from 'transformers.modeling_utils'"."""
    try:
        with warnings.catch_warnings():  # (AutoAWQ announces its deprecation on import)
            warnings.simplefilter("ignore")
            from awq.modules.linear.gemm import WQLinear_GEMM
    except ImportError:
        absent("autoawq (AutoAWQ's packer, the reference; requirements.txt pins it)")
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))  # [N, K]
    q, zero, scale = rtn(w, 32, symmetric=False)
    scale = scale.half().float()  # (AutoAWQ keeps its scales in fp16: these it holds exactly)
    linear = torch.nn.Linear(256, 64, bias=False)
    linear.weight.data = dequantized(q, zero, scale)
    reference = WQLinear_GEMM.from_linear(linear, 4, 32, scales=scale.t().contiguous(), zeros=zero.t().contiguous())
    ours = awq_tensors(q, zero, scale)
    assert torch.equal(ours["qweight"], reference.qweight) and torch.equal(ours["qzeros"], reference.qzeros)
    assert torch.equal(ours["scales"].half(), reference.scales)


# -- refusals

def damaged(folder, tmp_path, change_config=None, change_state=None):
    copy = tmp_path / "damaged"
    shutil.copytree(folder, copy)
    if change_config:
        config = json.loads((copy / "config.json").read_text())
        change_config(config["quantization_config"])
        (copy / "config.json").write_text(json.dumps(config))
    if change_state:
        state = load_file(copy / "model.safetensors")
        change_state(state)
        save_file(state, copy / "model.safetensors")
    return copy


def dense_k_proj(state):
    """A checkpoint whose layer 1 keeps k_proj in full precision beside quantized q and v."""
    stem = "model.layers.1.self_attn.k_proj"
    state.pop(f"{stem}.weight_packed"), state.pop(f"{stem}.weight_scale")
    n, k = state.pop(f"{stem}.weight_shape").tolist()
    state[f"{stem}.weight"] = torch.zeros(n, k)


@pytest.mark.parametrize("change_config, change_state, message", [
    (lambda q: q.update(quant_method="bitsandbytes"), None, "quant_method 'bitsandbytes' is not supported; supported: compressed-tensors, awq, gptq"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "float"}), None,
     "quantizes activations; supported: weight-only"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=2), None, "int2 weights by group; supported"),
    (None, lambda s: s.update({"model.layers.0.mlp.down_proj.weight_packed": s["model.layers.0.mlp.down_proj.weight_packed"][:, :5].contiguous()}),
     "layers.0.mlp.down_proj is not a compressed-tensors quantized projection (weight_packed (384, 5)"),
    (None, lambda s: s.pop("model.layers.1.self_attn.k_proj.weight_packed"), "(missing layers.1.self_attn.k_proj.weight_packed)"),
    (None, dense_k_proj, "layers.1.self_attn.q_proj, layers.1.self_attn.k_proj, layers.1.self_attn.v_proj are stored differently"),
    (None, lambda s: s.update({"model.layers.0.mlp.down_proj.weight_g_idx": torch.arange(1024).flip(0) // 32}),
     "layers.0.mlp.down_proj is not a compressed-tensors quantized projection (g_idx is not k // group_size (act order)"),
])
def test_damaged_or_unsupported_quantized_checkpoints_are_refused_in_one_line(compressed, tmp_path, change_config,
                                                                              change_state, message):
    folder = damaged(compressed["int4-sym"], tmp_path, change_config, change_state)
    with pytest.raises(CheckpointError) as caught:
        load_model(folder, torch.float32, "cpu")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_act_order_gptq_is_refused(tmp_path):
    packed, _ = quantized_pair(tmp_path, "gptq")
    folder = damaged(packed, tmp_path, lambda q: q.update(desc_act=True))
    with pytest.raises(CheckpointError, match="desc_act .act order. is not supported"):
        load_model(folder, torch.float32, "cpu")
    folder = damaged(packed, tmp_path / "..", None, lambda s: s.update(
        {"model.layers.0.mlp.up_proj.g_idx": s["model.layers.0.mlp.up_proj.g_idx"].flip(0)}))
    with pytest.raises(CheckpointError, match="act order"):
        load_model(folder, torch.float32, "cpu")



def test_unpack_reads_int4_words_of_any_strides():
    """GPTQ stores its words [K/8, N] and the loader reads them transposed: where K is 8 that is an
    [N, 1] view with strides (1, N), which .contiguous() leaves as it is (it counts as contiguous)."""
    from specgraph.quant.linear import unpack

    values = torch.randint(0, 16, (5, 8))  # [N, K]
    words = sum(values[:, i].to(torch.int64) << (4 * i) for i in range(8))  # [N]: value i in bits 4i to 4i + 3
    stored = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)[None, :].clone()  # [K/8, N]
    assert torch.equal(unpack(stored.t(), 4, 8).long(), values)


# -- the other paths a quantized model takes

def test_a_quantized_recipe_exports_and_its_package_decodes_the_same_tokens(compressed, tmp_path):
    recipe = two_stage(compressed["int4-asym"], DRAFT, CHAIN, max_new_tokens=NEW, max_seq_len=200)
    path = tmp_path / "recipe.yaml"
    path.write_text(recipe.to_yaml(tmp_path))
    assert main(["compile", str(path), "-o", str(tmp_path / "program")]) == 0
    result = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "specgraph.cli", "run", "--program", str(tmp_path / "program"),
                           "--prompt", PROMPTS[0]["prompt"], "--json", str(result)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(result.read_text())["results"][0]["output_ids"] == ours(compressed["int4-asym"])[0]


def test_quantized_weights_over_several_devices_or_widened_are_refused_in_one_line(compressed, capsys):
    recipe = two_stage(compressed["int4-sym"], None)
    split = recipe.model_copy(update={"stages": [recipe.stages[0].model_copy(update={"devices": ["cpu", "cpu"]})]})
    with pytest.raises(RecipeError, match="has quantized weights, which run on one device"):
        Program.from_recipe(split)
    with pytest.raises(SpecgraphError, match="--widen: the model has quantized weights; widen a checkpoint in full"):
        widen(load_model(compressed["int4-sym"], torch.float32, "cpu"), "llama-3-8b", "cpu", torch.float32)


@pytest.mark.parametrize("scheme, group", [("w4a16", None), ("w8a16", 64), ("fp8", None)])
def test_specgraph_quantize_writes_what_transformers_loads_and_we_decode_alike(tmp_path, capsys, scheme, group):
    out = tmp_path / "quantized"
    assert main(["quantize", str(TARGET), "-o", str(out), "--scheme", scheme,
                 *(["--group-size", str(group)] if group else [])]) == 0
    assert capsys.readouterr().out.strip().endswith(f"wrote {out}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quantized"]  # nothing left beside it
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = quantization["config_groups"]["group_0"]["weights"]
    assert (quantization["quant_method"], weights["num_bits"], weights["group_size"]) == (
        "compressed-tensors", 4 if scheme == "w4a16" else 8, {"w4a16": 128, "w8a16": 64, "fp8": None}[scheme])
    expected = [new for _, new in hf_greedy(out, PROMPTS, NEW)]
    assert ours(out) == expected
    assert ours(out, DRAFT, CHAIN) == expected


def test_round_to_nearest_quantizes_shard_by_shard_without_loading_the_model(tmp_path, monkeypatch, capsys):
    """A checkpoint larger than host memory quantizes: transformers never loads its weights, each
    source shard becomes the output's shard of that name (the index says where each tensor is), and
    a checkpoint whose names are not the model's is refused in one line."""
    def refuse(*args, **kwargs):
        raise AssertionError("round to nearest loaded the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    out = tmp_path / "w4"
    assert main(["quantize", str(TARGET), "-o", str(out), "--scheme", "w4a16"]) == 0
    where = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(file.name for file in safetensor_files(TARGET))
    assert len(shards) > 1 and sorted(set(where.values())) == shards
    for shard in shards:
        written, source = load_file(out / shard), load_file(TARGET / shard)
        assert set(written) == {name for name, file in where.items() if file == shard}
        for key, tensor in source.items():  # a projection compressed, every other tensor as it was
            stem = key.removesuffix(".weight")
            assert (f"{stem}.weight_packed" in written and key not in written if stem.endswith("_proj") else
                    torch.equal(written[key], tensor)), key
    renamed = tmp_path / "renamed"
    shutil.copytree(TARGET, renamed)
    for file in safetensor_files(renamed):
        state = load_file(file)
        if "model.layers.0.mlp.down_proj.weight" in state:
            state["model.layers.0.mlp.down.weight"] = state.pop("model.layers.0.mlp.down_proj.weight")
            save_file(state, file)
    capsys.readouterr()
    assert main(["quantize", str(renamed), "-o", str(tmp_path / "again"), "--scheme", "w4a16"]) == 2
    assert "no weight for model.layers.0.mlp.down_proj, a projection of the model its config describes" in (
        capsys.readouterr().err)
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("argv, message", [
    (["--scheme", "w4a16", "--group-size", "100"], "--group-size: 100 does not divide the 384 inputs of "
                                                   "model.layers.0.self_attn.q_proj"),
    (["--scheme", "fp8", "--group-size", "32"], "--group-size: fp8 weights are scaled per output row"),
    (["--scheme", "w4a16", "--group-size", "0"], "--group-size: must be at least 1 (got 0)"),
    (["--scheme", "int3"], "argument --scheme: invalid choice: 'int3' (choose from 'w4a16', 'w8a16', 'fp8')"),
    (["--scheme", "w4a16", "--method", "awq"], "--calibration: --method awq needs calibration prompts"),
    (["--scheme", "w4a16", "--calibration", "prompts.jsonl"], "--calibration: only --method awq reads calibration"),
    (["--scheme", "w4a16", "--device", "cpu"], "--device: only --method awq runs the model"),
    (["--scheme", "w4a16", "--method", "awq", "--calibration", "missing.jsonl"], "--calibration: missing.jsonl does "
                                                                                 "not exist"),
    (["--scheme", "w4a16", "--method", "awq", "--calibration", str(REPO / "README.md")], "README.md line 1 is not "
                                                                                         "JSON"),
    (["--scheme", "w4a16", "--method", "awq", "--calibration", str(REPO / "README.md"), "--device", "gpu0"],
     "--device: 'gpu0' is not a device"),
    (["--scheme", "w4a16", "--method", "awq", "--calibration", str(REPO / "README.md"), "--device", "meta"],
     "--device: 'meta' is not a device; valid: cpu, cuda, cuda:N"),
])
def test_specgraph_quantize_refuses_bad_settings_in_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) if "invalid choice" in message else contextlib.nullcontext():
        assert main(["quantize", str(TARGET), "-o", str(tmp_path / "out"), *argv]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error
    assert not (tmp_path / "out").exists()


def test_specgraph_quantize_refuses_an_output_in_use_a_quantized_source_and_a_vision_language_one(
        compressed, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert main(["quantize", str(TARGET), "-o", str(taken), "--scheme", "w4a16"]) != 0
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert (taken / "notes.txt").read_text() == "mine"
    assert main(["quantize", str(compressed["fp8"]), "-o", str(tmp_path / "again"), "--scheme", "w4a16"]) != 0
    assert "already quantized; quantize a model's checkpoint in full precision" in capsys.readouterr().err
    vision_language = as_vision_language(shared_model("hybrid"), tmp_path / "vision-language")
    assert main(["quantize", str(vision_language), "-o", str(tmp_path / "again"), "--scheme", "w4a16"]) != 0
    assert ("a Qwen3_5ForConditionalGeneration (vision-language) checkpoint, which quantize does not read yet; quantize "
            "its text model's checkpoint (Qwen3_5ForCausalLM)") in capsys.readouterr().err


def test_quantized_stages_under_the_disaggregated_and_pipeline_executors_keep_the_target_exact(compressed):
    target = compressed["int4-sym"]
    expected = [new for _, new in hf_greedy(target, PROMPTS, NEW)]
    split = two_stage(target, compressed["int4-asym"], DYNAMIC, execution="disaggregated", max_new_tokens=NEW)
    models = [DRAFT, compressed["fp8"], target]  # a plain drafter, an fp8 middle stage, the int4 target
    stages = [{"name": f"s{i}", "model": f"m{i}", "devices": ["cpu"]} for i in range(3)]
    stages[0]["tree"] = CHAIN
    stages[1]["verifies"], stages[2]["verifies"] = "s0", "s1"
    pipeline = Recipe.from_dict({"name": "pipeline", "execution": "pipeline", "max_new_tokens": NEW, "stages": stages,
                                 "models": {f"m{i}": {"path": str(m), "dtype": "float32"} for i, m in enumerate(models)}})
    for recipe in (split, pipeline):
        with Program.from_recipe(recipe) as program:
            assert [program.generate(program.encode(row["prompt"])).output_ids for row in PROMPTS] == expected


def calibration_file(folder, prompts: list[dict]):
    file = folder / "calibration.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in prompts))
    return file


def divergences(reference, quantized: list, prompts: list[dict]) -> list[float]:
    """For each quantized checkpoint, the mean KL(reference || it) of transformers' next-token
    distributions (fp32) over every position of the prompts."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(reference)
    ids = [torch.tensor([tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]]) for row in prompts]
    with torch.no_grad():
        laws = [[transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(x).logits[0].log_softmax(-1)
                 for x in ids] for path in (reference, *quantized)]
    positions = sum(len(p) for p in laws[0])
    return [(sum((p.exp() * (p - q)).sum() for p, q in zip(laws[0], law)) / positions).item() for law in laws[1:]]


def test_awq_writes_what_transformers_loads_and_we_decode_alike_and_errs_less_than_round_to_nearest(tmp_path,
                                                                                                     all_code_prompts):
    """Scales and clips searched on half the code prompts: on 16 others the int4 model's next-token
    laws are nearer the full-precision model's than round to nearest's (measured: KL 0.027 against
    0.037)."""
    calibration, held_out = all_code_prompts[:32], all_code_prompts[32:48]
    awq, rtn = tmp_path / "awq", tmp_path / "rtn"
    assert main(["quantize", str(TARGET), "-o", str(awq), "--scheme", "w4a16", "--method", "awq",
                 "--calibration", str(calibration_file(tmp_path, calibration))]) == 0
    assert main(["quantize", str(TARGET), "-o", str(rtn), "--scheme", "w4a16"]) == 0
    expected = [new for _, new in hf_greedy(awq, PROMPTS, NEW)]
    assert ours(awq) == expected
    assert ours(awq, DRAFT, CHAIN) == expected
    kl_awq, kl_rtn = divergences(TARGET, [awq, rtn], held_out)
    assert kl_awq < 0.9 * kl_rtn and kl_rtn < 0.06



def test_awq_keeps_the_tensors_transformers_ignores_and_the_sources_index(small_hybrid, tmp_path, code_prompts):
    """A Qwen3.5 checkpoint in one shard named by an index, with a multi-token-prediction tensor
    (mtp.*, which transformers' Qwen3_5ForCausalLM ignores): the output keeps that tensor and an
    index, and transformers and we decode it alike."""
    source = tmp_path / "one-shard"
    shutil.copytree(small_hybrid, source, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    state = {k: v for file in safetensor_files(small_hybrid) for k, v in load_file(file).items()}
    state["mtp.norm.weight"] = torch.arange(8.0)
    save_file(state, source / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    (source / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(state, "model-00001-of-00001.safetensors")}))
    out = tmp_path / "awq"
    assert main(["quantize", str(source), "-o", str(out), "--scheme", "w4a16", "--group-size", "32", "--method", "awq",
                 "--calibration", str(calibration_file(tmp_path, code_prompts[:4]))]) == 0
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]["mtp.norm.weight"] == (
        "model-00001-of-00001.safetensors")
    assert torch.equal(load_file(out / "model-00001-of-00001.safetensors")["mtp.norm.weight"], torch.arange(8.0))
    program = Program.from_recipe(two_stage(out, None, None, max_new_tokens=16))
    assert [program.generate(program.encode(row["prompt"])).output_ids for row in PROMPTS] == [
        new for _, new in hf_greedy(out, PROMPTS, 16)]


def quantize_is_refused(capsys, source, out, flags: list[str], message: str) -> None:
    """`specgraph quantize SOURCE -o OUT --scheme w4a16 FLAGS` exits 2 with `message` in its one-line
    error, no traceback, and no OUT."""
    assert main(["quantize", str(source), "-o", str(out), "--scheme", "w4a16", *flags]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert message in error[-1] and not any("Traceback" in line for line in error), (message, error[-1])
    assert not out.exists()


def test_awq_refuses_calibration_it_cannot_tokenize_before_it_loads_the_model(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("awq loaded the model before it tokenized its calibration")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    untokenized, damaged = tmp_path / "untokenized", tmp_path / "damaged"
    shutil.copytree(TARGET, untokenized, ignore=shutil.ignore_patterns("tokenizer*"))
    shutil.copytree(TARGET, damaged)
    (damaged / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
    for source, prompts, message in [
            (TARGET, [{"prompt": ""}], "--calibration: its prompts encode to no tokens; give prompts with text"),
            (untokenized, PROMPTS, f"{untokenized}: no tokenizer that transformers can load; give a checkpoint with"),
            (damaged, PROMPTS, f"{damaged}: no tokenizer that transformers can load; give a checkpoint with")]:
        quantize_is_refused(capsys, source, tmp_path / "out", ["--method", "awq", "--calibration",
                                                               str(calibration_file(tmp_path, prompts))], message)


def test_quantize_refuses_unreadable_or_foreign_sources_and_unwritable_outputs_in_one_line(tmp_path, monkeypatch,
                                                                                        capsys, code_prompts):
    """A truncated shard (round to nearest reads it, awq's transformers loads it), a tensor that is
    no weight of the model and that transformers does not ignore (awq: a folded model's tensor would
    be written unfolded), and an output that cannot be written (a full disk)."""
    import safetensors.torch

    truncated, foreign = tmp_path / "truncated", tmp_path / "foreign"
    shutil.copytree(TARGET, truncated)
    shard = safetensor_files(truncated)[0]
    shard.write_bytes(shard.read_bytes()[:4096])
    shutil.copytree(TARGET, foreign)
    state = load_file(safetensor_files(foreign)[0])
    save_file(state | {"model.layers.0.extra.weight": torch.zeros(4)}, safetensor_files(foreign)[0])
    awq = ["--method", "awq", "--calibration", str(calibration_file(tmp_path, code_prompts[:1]))]
    for source, flags, message in [
            (truncated, [], f"{shard}: not a readable safetensors file"),
            (truncated, awq, f"{truncated}: transformers cannot load it"),
            (foreign, awq, "tensor model.layers.0.extra.weight is not a weight of the model transformers builds")]:
        quantize_is_refused(capsys, source, tmp_path / "out", flags, message)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(["quantize", str(TARGET), "-o", str(tmp_path / "out"), "--scheme", "w4a16"]) == 2
    assert f"-o: cannot write {tmp_path / 'out'}: No space left on device" in capsys.readouterr().err
    assert list(tmp_path.glob(".out.*")) == [] and not (tmp_path / "out").exists()  # (nor its staging folder)


@pytest.mark.parametrize("norm", ["LlamaRMSNorm", "Qwen3_5RMSNorm"])
def test_awq_folds_into_a_norm_the_division_its_rounded_weight_makes(norm):
    """Each input channel's multiplier (the norm's weight, or Qwen3.5's 1 + weight) times the
    projection's weight column is kept to the bf16 rounding of that column (2^-9), for scales from
    1/100 to 100: folding 1/s into 1 + weight rounded in bf16 loses several percent of a small one."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from specgraph.quant.awq import ScaleSet, fold

    k, offset = 512, 1.0 if norm == "Qwen3_5RMSNorm" else 0.0
    before = {"LlamaRMSNorm": LlamaRMSNorm, "Qwen3_5RMSNorm": Qwen3_5RMSNorm}[norm](k).to(torch.bfloat16)
    projection = torch.nn.Linear(k, 64, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        before.weight.copy_(torch.randn(k) * 0.3 + (1 - offset))
        product = lambda: (offset + before.weight.double()) * projection.weight.double()  # noqa: E731  [N, K]
        kept = product()
        fold(ScaleSet(before, [projection], []), torch.exp(torch.randn(k) * 1.5))
        assert ((product() - kept).abs() <= kept.abs() * 2**-8).all()


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_a_quantized_hybrid_target_decodes_as_transformers_decodes_it(small_hybrid, tmp_path, code_prompts, method):
    """Qwen3.5's gated-DeltaNet projections (in_proj_qkv, z, b, a fused) and attention quantized alike
    (awq: its scales folded into Qwen3.5's 1 + weight norms)."""
    out = tmp_path / "hybrid-w4"
    awq = ["--method", "awq", "--calibration", str(calibration_file(tmp_path, code_prompts[:8]))] if method == "awq" else []
    assert main(["quantize", str(small_hybrid), "-o", str(out), "--scheme", "w4a16", "--group-size", "32", *awq]) == 0
    expected = [new for _, new in hf_greedy(out, PROMPTS, 24)]
    assert expected != [new for _, new in hf_greedy(small_hybrid, PROMPTS, 24)]
    program = Program.from_recipe(two_stage(out, DRAFT, CHAIN, max_new_tokens=24))
    assert [program.generate(program.encode(row["prompt"])).output_ids for row in PROMPTS] == expected


@pytest.mark.parametrize("scheme, group", [("w4a16", 32), ("w8a16", None), ("fp8", None)])
def test_quantizing_in_memory_stores_what_the_written_checkpoint_loads_as(tmp_path, scheme, group):
    """quantize_linear (what --widen SHAPE:SCHEME does to each layer) against the checkpoint that
    `specgraph quantize` has compressed-tensors write, read back through the loader: the same bits."""
    out = tmp_path / "quantized"
    assert main(["quantize", str(TARGET), "-o", str(out), "--scheme", scheme,
                 *(["--group-size", str(group)] if group else [])]) == 0
    loaded, plain = (load_model(path, torch.bfloat16, "cpu") for path in (out, TARGET))  # (the checkpoint's dtype)
    quantized = {name: m for name, m in loaded.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 4 * len(plain.layers)  # qkv, o, gate_up, down of every layer
    for name, stored in quantized.items():
        made = quantize_linear(plain.get_submodule(name), scheme, group)
        assert (made.format, made.group) == (stored.format, stored.group), name
        for tensor in ("weight", "scales", "zeros"):
            assert torch.equal(getattr(made, tensor), getattr(stored, tensor)) if stored.zeros is not None or \
                tensor != "zeros" else made.zeros is None, (name, tensor)


def with_plain_linears(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose QuantLinear projections are plain nn.Linear ones of the weights they
    stand for (fp32): the function the quantized model computes, for transformers to run."""
    import copy

    from specgraph.quant.linear import dequantize, put

    dense = copy.deepcopy(model)
    for name, module in list(dense.named_modules()):
        if isinstance(module, QuantLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = dequantize(module.weight, module.scales, module.zeros, module.format, module.group,
                                            module.in_features, torch.float32)
            put(dense, name, linear)
    return dense


def test_widening_to_a_quantized_shape_quantizes_each_layer_and_speculation_stays_exact(capsys):
    """`--widen SHAPE:SCHEME` (models/widen.py): an 8B-like layout (REDUCED) built layer by layer with
    int4 projections; speculation over it decodes what transformers' greedy decoding of the same
    function does (its weights dequantized, run by transformers' Llama)."""
    from specgraph.bench.systems import hf_mirror
    from specgraph.models.loader import read_config

    graph = plan(two_stage(TARGET, DRAFT, DYNAMIC, max_new_tokens=NEW))
    small = Program(graph)
    wide = widen(small.stages["target"].model, REDUCED, "cpu", torch.float32, quantize="w4a16")
    projections = [m for m in wide.layers.modules() if isinstance(m, (QuantLinear, torch.nn.Linear))]
    assert len(projections) == 4 * REDUCED.num_layers
    assert all(isinstance(m, QuantLinear) and (m.format, m.group) == ("int4", 128) for m in projections)
    program = Program(graph, {"target": wide})
    ids = program.encode("def load(path):\n    with open(path) as f:\n")
    generation = program.generate(ids)
    transformers_llama = hf_mirror(with_plain_linears(wide), read_config(TARGET))
    assert generation.output_ids == hf_continuation(transformers_llama, ids, NEW, served_vocab=wide.served_vocab)
    assert sum(generation.accepted_lengths) > 1.3 * len(generation.accepted_lengths)
    assert main(["bench", str(REPO / "recipes" / "demo.yaml"), "--widen", "llama-3-8b:int3"]) != 0
    assert capsys.readouterr().err.strip().endswith("--widen llama-3-8b:int3: unknown quantization scheme 'int3'; "
                                                    "valid: w4a16, w8a16, fp8 (or none: --widen llama-3-8b)")
