"""On a GPU: CUDA-graph replay gives the same tokens as eager forwards, and speculation in bf16
gives the tokens of our own autoregressive decoding of the same program where it is exact."""

import pytest
import torch
from conftest import EMBEDDED
from helpers import two_stage

from specgraph.program import Program

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Tree:\n    \"\"\"A rooted tree.\"\"\"\n\n    def __init__(self"]


def on_gpu(tree: dict, **fields) -> Program:
    recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", tree, **fields)
    recipe = recipe.model_copy(update={"stages": [s.model_copy(update={"devices": ["cuda:0"]}) for s in recipe.stages]})
    return Program.from_recipe(recipe)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_replay_the_eager_program(dtype):
    tree = {"shape": "static", "branching": [2, 2, 1]}
    graphed = on_gpu(tree, dtype=dtype, max_new_tokens=64, lowering={"compile": False})
    eager = on_gpu(tree, dtype=dtype, max_new_tokens=64, lowering={"compile": False, "cuda_graphs": False})
    assert graphed.graph.node("target")["graph_buckets"] == (1, 9)
    for text in PROMPTS:
        ids = graphed.encode(text)
        assert graphed.generate(ids).output_ids == eager.generate(ids).output_ids
    assert graphed.stages["target"]._graphs and not eager.stages["target"]._graphs


def test_fp32_speculation_on_gpu_equals_autoregressive():
    program = on_gpu({"shape": "chain", "length": 4}, max_new_tokens=64)
    for text in PROMPTS:
        ids = program.encode(text)
        assert program.generate(ids).output_ids == program.autoregressive().generate(ids, 64).output_ids


def test_compiled_layers_give_the_eager_tokens_on_gpu():
    tree = {"shape": "chain", "length": 4}
    compiled = on_gpu(tree, max_new_tokens=48)  # compiled by default on a GPU
    eager = on_gpu(tree, max_new_tokens=48, lowering={"compile": False})
    assert compiled.graph.node("target")["compile"] and not eager.graph.node("target")["compile"]
    for text in PROMPTS:
        ids = compiled.encode(text)
        assert compiled.generate(ids).output_ids == eager.generate(ids).output_ids
