"""Many requests at once (specgraph/engine/): requests of mixed prompt lengths and budgets, decoded
five at a time with staggered finishes, give each the tokens transformers' greedy decoding gives it
(fp32 on the CPU), for static and dynamic trees, the autoregressive target and a hybrid target;
`specgraph run --batch` writes what one-at-a-time decoding writes."""

import json

import pytest
from conftest import EMBEDDED, REPO
from helpers import two_stage

from specgraph.cli import main
from specgraph.program import Program

BUDGETS = [8, 48, 16, 64, 24, 40, 8, 56, 32, 12, 64, 20]  # new tokens of each of 12 requests: staggered finishes
TREES = {"static": {"shape": "static", "branching": [3, 2, 1]},
         "dynamic": {"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}}


def decode_together(program: Program, reference, budgets=BUDGETS) -> list[list[int]]:
    """Every request in the engine at once (it admits max_batch of them), each with its own budget."""
    engine = program.executor
    requests = [engine.add_request(ids, budget) for (ids, _), budget in zip(reference, budgets)]
    in_flight = []
    while engine.busy:
        engine.step()
        in_flight.append(sum(r.status == "decode" for r in requests))
    assert max(in_flight) == program.recipe.serving.max_batch  # the batch was full at times
    return [r.generation.output_ids for r in requests]


@pytest.mark.parametrize("tree", list(TREES) + [None], ids=list(TREES) + ["autoregressive"])
def test_five_at_a_time_each_request_gets_the_target_greedy_tokens(target_reference, tree):
    program = Program.from_recipe(two_stage(EMBEDDED / "target", None if tree is None else EMBEDDED / "draft",
                                            TREES.get(tree), serving={"max_batch": 5, "block_size": 16}))
    outputs = decode_together(program, target_reference)
    assert outputs == [expected[:budget] for (_, expected), budget in zip(target_reference, BUDGETS)]


def test_a_hybrid_target_five_at_a_time(hybrid_reference, small_hybrid):
    """The gated-DeltaNet state of each request in a slot of its own."""
    from conftest import shared_models

    program = Program.from_recipe(two_stage(shared_models() / "hybrid", small_hybrid, TREES["static"],
                                            serving={"max_batch": 5, "block_size": 16}))
    budgets = [b // 2 for b in BUDGETS]
    outputs = decode_together(program, hybrid_reference, budgets)
    assert outputs == [expected[:budget] for (_, expected), budget in zip(hybrid_reference, budgets)]


def test_run_with_batch_writes_what_one_at_a_time_writes(tmp_path, code_prompts):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": row["prompt"][: 40 + 37 * i]}) + "\n"
                               for i, row in enumerate(code_prompts[:7])))
    reports = []
    for batch in ("1", "4"):
        out = tmp_path / f"b{batch}.json"
        assert main(["run", str(REPO / "recipes" / "tree.yaml"), "--prompts", str(prompts), "--max-new-tokens", "24",
                     "--batch", batch, "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    one, four = ([(r["id"], r["output_ids"]) for r in report["results"]] for report in reports)
    assert one == four and [i for i, _ in one] == [f"p{i}" for i in range(7)]


def test_batch_above_one_is_refused_for_executors_that_decode_one_request_at_a_time(capsys):
    assert main(["run", str(REPO / "recipes" / "disaggregated.yaml"), "--batch", "2", "--set",
                 "stages.0.devices=[cpu]", "--set", "stages.1.devices=[cpu]"]) == 2
    assert ("--batch: execution 'disaggregated' decodes one request at a time; give --batch 1, or a serial recipe"
            in capsys.readouterr().err)
