"""The Triton kernels wired into a whole program (the interpreter on the CPU) decode transformers'
greedy tokens: attention, rotary + cache write, the one-token projection (the drafter's steps and
autoregressive decoding), add + RMSNorm, SwiGLU, KV moves and acceptance all in use; sampled with
one seed, they draw the reference program's tokens."""

from conftest import EMBEDDED
from helpers import ORACLE_TOKENS, PROMPT, hf_greedy, run_noting_projections, two_stage

from specgraph.kernels.attention.triton import attention
from specgraph.kernels.gumbel.triton import perturbed_top
from specgraph.kernels.kv_move.triton import kv_move
from specgraph.program import Program


def test_triton_kernels_decode_transformers_tokens():
    """Every step in Triton, interpreted on the CPU (slow: half the oracle's tokens)."""
    tokens = ORACLE_TOKENS // 2
    recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "static", "branching": [2, 1]},
                       max_new_tokens=tokens, lowering={"kernels": "triton"})
    fused = Program.from_recipe(recipe)
    assert fused.stages["target"].model.layers[0].self_attn.kernels.attention is attention
    assert fused.stages["draft"].cache.kernels.kv_move is kv_move
    [(ids, expected)] = hf_greedy(EMBEDDED / "target", [{"prompt": PROMPT}], tokens)
    result = fused.generate(ids)
    assert result.output_ids == expected
    assert max(result.accepted_lengths) > 1  # drafts were accepted, so KV moves ran on real paths
    # the target's one-token projections (slow in the interpreter: a few steps)
    assert fused.autoregressive().generate(ids, 2).output_ids == expected[:2]


def test_triton_kernels_sample_the_reference_tokens():
    """Sampling with one seed (the sampling rule): the fused Gumbel kernel adds the reference's noise,
    so the tokens agree unless the kernels' last-bit differences move a perturbed argmax."""
    def program(kernels: str) -> Program:
        recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "static", "branching": [2, 1]},
                           max_new_tokens=12, sampling={"temperature": 0.8}, lowering={"kernels": kernels})
        return Program.from_recipe(recipe)

    fused, reference = program("triton"), program("reference")
    assert fused.executor.runner.verifier.kernels.perturbed_top is perturbed_top
    ids = fused.encode("def parse(path):\n    with open(path) as f:\n")
    result = fused.generate(ids, seed=3)
    assert result.output_ids == reference.generate(ids, seed=3).output_ids
    assert max(result.accepted_lengths) > 1


def test_row_invariant_kernels_decode_the_reference_tokens():
    """lowering.row_invariant (over reference kernels elsewhere): the target projects (logits head
    included), gates and attends with the row-invariant kernels; greedy tokens are the reference
    program's."""
    from specgraph.kernels.attention.invariant import attention_invariant
    from specgraph.kernels.linear.invariant import linear_invariant

    def program(lowering: dict) -> Program:
        recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "static", "branching": [2, 1]},
                           max_new_tokens=8, lowering=lowering)
        return Program.from_recipe(recipe)

    invariant, reference = program({"kernels": "reference", "row_invariant": True}), program({"kernels": "reference"})
    target = invariant.stages["target"].model
    assert target.layers[0].self_attn.kernels.attention is attention_invariant
    assert target.kernels.linear is linear_invariant
    assert invariant.stages["draft"].model.kernels == reference.stages["draft"].model.kernels  # the drafter's own
    ids = invariant.encode("def parse(path):\n    with open(path) as f:\n")
    result, unprojected = run_noting_projections(target, lambda: invariant.generate(ids))
    assert result.output_ids == reference.generate(ids).output_ids
    assert max(result.accepted_lengths) > 1
    assert not unprojected  # qkv too
