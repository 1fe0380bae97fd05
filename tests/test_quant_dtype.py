"""A quantized checkpoint computes in the dtype the recipe asks for: `specgraph quantize` of a bf16
model writes bf16 scales, and at dtype float32 transformers widens them and dequantizes in fp32;
so do we (issue 44, defect 8: we dequantized in bf16, and greedy output parted from transformers')."""

import pytest
import torch
import transformers
from conftest import EMBEDDED
from helpers import chain_logits, hf_greedy, two_stage
from safetensors import safe_open

from specgraph.cli import main
from specgraph.models.loader import load_model
from specgraph.program import Program

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    for path in argv[1:]:\n"


@pytest.fixture(scope="module")
def bf16_scales(tmp_path_factory):
    """The embedded target (stored in bf16) quantized to int4 by `specgraph quantize`."""
    out = tmp_path_factory.mktemp("w4") / "w4"
    assert main(["quantize", str(EMBEDDED / "target"), "-o", str(out), "--scheme", "w4a16"]) == 0
    with safe_open(next(out.glob("*.safetensors")), "pt") as f:
        assert {f.get_tensor(n).dtype for n in f.keys() if n.endswith("weight_scale")} == {torch.bfloat16}
    return out


def test_an_fp32_run_of_bf16_scales_has_transformers_logits(bf16_scales):
    hf = transformers.AutoModelForCausalLM.from_pretrained(bf16_scales, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(bf16_scales)(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]  # [T, V]
        ours = chain_logits(load_model(bf16_scales, torch.float32, "cpu"), torch.tensor(ids))
    assert (ours - expected).abs().max() < 1e-4  # fp32's rounding; dequantized in bf16 it was 0.05 here


def test_an_fp32_run_of_bf16_scales_decodes_transformers_tokens(bf16_scales, code_prompts):
    prompts = code_prompts[3:4]  # (in bf16 its greedy output parted from transformers' at token 39)
    expected = [new for _, new in hf_greedy(bf16_scales, prompts, 48)]
    program = Program.from_recipe(two_stage(bf16_scales, None, max_new_tokens=48))
    assert [program.generate(program.encode(row["prompt"])).output_ids for row in prompts] == expected
