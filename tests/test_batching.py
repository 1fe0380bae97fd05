"""Many requests at once (specgraph/engine/): requests of mixed prompt lengths and budgets, decoded
five at a time with staggered finishes, give each the tokens transformers' greedy decoding gives it
(fp32 on the CPU), for static and dynamic trees, the autoregressive target and a hybrid target;
`specgraph run --batch` writes what one-at-a-time decoding writes."""

import itertools
import json
from pathlib import Path

import pytest
from conftest import EMBEDDED, REPO
from helpers import BUDGETS, decode_together, two_stage

from specgraph.cli import main
from specgraph.program import Program

TREES = {"static": {"shape": "static", "branching": [3, 2, 1]},
         "dynamic": {"shape": "dynamic", "width": 3, "depth": 4, "nodes": 10}}


@pytest.mark.parametrize("tree, bucketed", [*((tree, False) for tree in TREES), (None, False), ("dynamic", True)],
                         ids=[*TREES, "autoregressive", "bucketed-prompts"])
def test_five_at_a_time_each_request_gets_the_target_greedy_tokens(target_reference, tree, bucketed):
    """`bucketed`: prompt chunks packed as a GPU's captured forwards pack them (tokens and chunks padded
    to powers of two, the added chunks empty ones of the padding row), here run as they are."""
    program = Program.from_recipe(two_stage(EMBEDDED / "target", None if tree is None else EMBEDDED / "draft",
                                            TREES.get(tree), serving={"max_batch": 5, "block_size": 16}))
    program.executor.runner.captured = bucketed
    outputs = decode_together(program, target_reference)
    assert outputs == [expected[:budget] for (_, expected), budget in zip(target_reference, BUDGETS)]


@pytest.mark.parametrize("batch", [1, 5])
def test_a_request_that_finished_while_its_next_step_ran_gets_nothing_more(target_reference, batch):
    """The engine launches a step before it reads the one before, so a request that finished in a step
    may be in the next one too: that step's tokens for it are dropped (it gets transformers' tokens, none
    past its end), and its blocks go back to the pool once (the pool refuses a second release). One sure
    to end in the step in flight (a token from its budget) is not launched again."""
    program = Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft", TREES["dynamic"],
                                            serving={"max_batch": batch, "block_size": 16, "speculation": "always"}))
    engine = program.executor
    collect, late = engine.runner.collect, []

    def noting(launched, keep):
        late.extend(kept for kept in keep if not kept)
        return collect(launched, keep)

    engine.runner.collect = noting
    requests = [engine.add_request(ids, budget) for (ids, _), budget in zip(target_reference, BUDGETS)]
    relaunched = []  # requests launched again while the step in flight was sure to end them
    while engine.busy:
        before = engine._in_flight.requests if engine._in_flight else []
        room = {id(r): r.output.room for r in before}
        engine.step()
        after = engine._in_flight.requests if engine._in_flight else []
        relaunched += [r for r in after if room.get(id(r), 2) <= 1]
    assert [r.generation.output_ids for r in requests] == [new[:b] for (_, new), b in zip(target_reference, BUDGETS)]
    assert late and not relaunched  # (some ended in a step that gave them more than one token: those ran on)
    pool = engine.scheduler.pool
    assert pool.free == pool.blocks - 1  # every block back (the trash is never lent)


@pytest.mark.parametrize("budget", [None, {1: 6, 4: 12, 8: 20}], ids=["trees", "budget"])
def test_steps_padded_to_capture_sizes_keep_every_request_exact(target_reference, monkeypatch, budget):
    """Steps padded as a GPU's captured steps are (here to 4 or 8 rows: runner.CAPTURE_SIZES patched),
    run as they are: five requests at a time run 8 rows, then 4 as they finish; each request gets
    transformers' greedy tokens, no padding row's tokens reach one, and under a budget (that of the
    step's rows) the padding rows verify no node: a root alone each."""
    from specgraph.engine import runner as runner_module
    from specgraph.engine.calibrate import prompt_shapes, step_shapes, warm_up

    monkeypatch.setattr(runner_module, "CAPTURE_SIZES", (4, 8))
    verify = None if budget is None else {"budget": {"epsilon": 0.1, "nodes": budget}}
    program = Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft", TREES["dynamic"], verify=verify,
                                            serving={"max_batch": 5, "block_size": 16}))
    runner = program.executor.runner
    runner.captured = True  # (here only the padding and the prompt buckets: a CPU captures nothing)
    # the build's warm-up of every shape, as on a GPU (8 rows: past the 5 request slots, the padding row), leaves
    # every slot as it was (the outputs below are transformers')
    warm_up(runner, runner.modes, step_shapes(runner, 5), prompt_shapes(runner, 5, 64), None, 32)
    grow, steps = runner.drafter.draft, []

    def recording(requests, width, sampling, budget, live):
        draft = grow(requests, width, sampling, budget, live)
        steps.append((requests.size, int(live.sum()), draft.tree.counts()[~live].tolist()))
        return draft

    runner.drafter.draft = recording
    outputs = decode_together(program, target_reference)
    assert outputs == [expected[:b] for (_, expected), b in zip(target_reference, BUDGETS)]
    assert {rows for rows, _, _ in steps} == {4, 8} and any(live < rows for rows, live, _ in steps)
    if budget is not None:
        assert all(size == 1 for _, _, padding in steps for size in padding)


def test_a_hybrid_target_five_at_a_time(hybrid_reference, small_hybrid):
    """The gated-DeltaNet state of each request in a slot of its own."""
    from conftest import shared_model

    program = Program.from_recipe(two_stage(shared_model("hybrid"), small_hybrid, TREES["static"],
                                            serving={"max_batch": 5, "block_size": 16}))
    budgets = [b // 2 for b in BUDGETS]
    outputs = decode_together(program, hybrid_reference, budgets)
    assert outputs == [expected[:budget] for (_, expected), budget in zip(hybrid_reference, budgets)]


@pytest.mark.parametrize("kind, chunk, chars", [("tree", 32, 20), ("head", 32, 20), ("hybrid", 512, 150)])
def test_short_prompts_go_in_together_and_each_decodes_exact(code_prompts, kind, chunk, chars):
    """Newcomers share a step's chunk of prompt tokens, earliest first, the last one split where the
    chunk runs out: every prompt is in after ceil(prompt tokens / chunk) steps (the step that feeds a
    prompt's last chunk launches its first decoding step, whose tokens the next step collects), and
    each request still gets transformers' greedy tokens. A drafting tree, an EAGLE-3 head (the
    target's features of each chunk), and a hybrid target (chunks of many requests past its 128
    tokens a request, each in its own state)."""
    import math

    from conftest import shared_model
    from helpers import hf_greedy

    target = shared_model("hybrid") if kind == "hybrid" else EMBEDDED / "target"
    draft = EMBEDDED / ("eagle3" if kind == "head" else "draft")
    tree = {"shape": "dynamic", "width": 3, "depth": 3, "nodes": 8} if kind == "head" else TREES["static"]
    reference = hf_greedy(target, [{"prompt": row["prompt"][: chars + 23 * i]} for i, row in enumerate(code_prompts[:6])],
                          12)
    program = Program.from_recipe(two_stage(target, draft, tree, serving={"max_batch": 6, "block_size": 16,
                                                                            "prefill_chunk": chunk}))
    engine = program.executor
    if kind == "hybrid":  # each prompt in one forward, the step's more than one forward of a request may hold
        assert engine.prefill_share == 128 and all(len(ids) - 1 <= 128 for ids, _ in reference)
    requests = [engine.add_request(ids, 12) for ids, _ in reference]
    first = {}  # request -> the step that gave it its first tokens (the one after its prompt went all in)
    for step in itertools.count(1):
        if not engine.busy:
            break
        for request in engine.step():
            first.setdefault(request.id, step)
    fed = sum(len(ids) - 1 for ids, _ in reference)  # (a prompt's last token goes in with the first step)
    assert max(first.values()) - 1 == math.ceil(fed / chunk) < len(requests) and (kind != "hybrid" or fed > 128)
    assert [r.generation.output_ids for r in requests] == [new for _, new in reference]


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
    assert main(["run", str(REPO / "recipes" / "disaggregated.yaml"), "--prompt", "x", "--batch", "2", "--set",
                 "stages.0.devices=[cpu]", "--set", "stages.1.devices=[cpu]"]) == 2
    assert ("--batch: execution 'disaggregated' decodes one request at a time; give --batch 1, or a serial recipe"
            in capsys.readouterr().err)


def test_the_budget_takes_the_most_likely_nodes_over_the_whole_batch():
    """select(): B nodes, best first over every request's candidates (each its own `nodes` best),
    ancestor-closed, in pool order per request; sizes and the packed total say how many."""
    import torch

    from specgraph.draft import _Grown, select

    # two requests' pools: root 0, children 1-3 of the root, 4-6 children of node 1 (scores: log-probs)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 1, 1]] * 2)
    scores = torch.tensor([[0, -0.1, -2.0, -3.0, -0.3, -0.4, -5.0],
                           [0, -1.0, -1.5, -0.2, -1.2, -1.3, -1.4]], dtype=torch.float64)
    depths = torch.tensor([[0, 1, 1, 1, 2, 2, 2]] * 2)
    lineage = torch.eye(7, dtype=torch.bool).repeat(2, 1, 1)
    lineage[:, :, 0] = True
    lineage[:, 4:, 1] = True
    grown = _Grown(torch.arange(14).view(2, 7), parents, depths, scores, lineage, torch.full((2, 7), -1))
    draft = select(grown, nodes=3, depth=2, width=3, budget=4, feeds=torch.tensor([2, 2]))
    # candidates: request 0's best 3 (-0.1, -0.3, -0.4), request 1's (-0.2, -1.0, -1.2); the best 4 of all six
    assert draft.tree.sizes.tolist() == [4, 2] and draft.tree.packed == 6
    assert draft.tree.tokens[0, :4].tolist() == [0, 1, 4, 5] and draft.tree.tokens[1, :2].tolist() == [7, 10]
    assert draft.tree.parents[0, :4].tolist() == [-1, 0, 1, 1] and draft.tree.parents[1, :2].tolist() == [-1, 0]
    alone = select(grown, nodes=3, depth=2, width=3, budget=None, feeds=torch.tensor([2, 2]))
    assert alone.tree.sizes is None and alone.tree.tokens[1].tolist() == [7, 8, 10, 11]


def test_a_budget_verifies_its_nodes_and_keeps_every_request_exact(target_reference):
    """Requests five at a time under a budget that grows with the batch (a fixed table: calibration
    on a busy CPU would make the trees vary from run to run), every step speculating: each still gets
    the target's greedy tokens, drafts are accepted, and every step packs its batch's budget of
    nodes: by hand, shares per request 6, 4, 3 and 2.8 at 1, 2, 4 and 5 requests, so 6, 8, 9 (three
    requests take four's share), 12 and 14 nodes, all verified but where too few live rows hold them."""
    table = {1: 6, 2: 8, 4: 12, 5: 14}
    program = Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft",
                                            {"shape": "dynamic", "width": 3, "depth": 4, "nodes": 8},
                                            verify={"budget": {"epsilon": 0.1, "nodes": table}},
                                            serving={"max_batch": 5, "block_size": 16}))
    drafter, verified = program.executor.runner.drafter, []
    grow = drafter.draft

    def recording(requests, width, sampling, budget, live):
        draft = grow(requests, width, sampling, budget, live)
        verified.append((requests.size, int(live.sum()), int(draft.tree.sizes.sum()) - requests.size,
                         draft.tree.packed))
        return draft

    drafter.draft = recording
    outputs = decode_together(program, target_reference)
    assert outputs == [expected[:budget] for (_, expected), budget in zip(target_reference, BUDGETS)]
    by_hand = {1: 6, 2: 8, 3: 9, 4: 12, 5: 14}
    # (a request that finished while the step ran runs as a padding row: it takes no node, 8 at most each of the rest)
    assert all(nodes == min(by_hand[batch], 8 * live) and packed == batch + by_hand[batch]
               for batch, live, nodes, packed in verified)
    assert {batch for batch, *_ in verified} >= {5, 1}  # a full batch, and the last request alone


def test_the_budget_is_calibrated_from_measured_steps(monkeypatch):
    """B(c): the most nodes per request whose verification of c requests stays within (1 + epsilon) of
    a plain step's. The engine's own steps run; their time comes from a clock that charges 10 ms a target
    forward and 1 ms a packed token (a CPU's measured times vary too much under load to test on), so by
    hand, c requests with k nodes each take 10 + c (k + 1) ms against a plain step's 10 + c: at epsilon
    0.25 a batch of one may take 2 nodes (13 ms <= 1.25 x 11 ms < 14 ms), one of two 1 each (14 ms <=
    1.25 x 12 ms < 16 ms)."""
    from helpers import Ledger

    from specgraph.engine.calibrate import budget_table
    from specgraph.runtime.stage import Stage

    program = Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft",
                                            {"shape": "dynamic", "width": 2, "depth": 2, "nodes": 4},
                                            serving={"max_batch": 2, "block_size": 16, "speculation": "always"}))
    runner = program.executor.runner
    ledger = Ledger({"target": (0.010, 0.001), "draft": (0.0, 0.0)})
    monkeypatch.setattr(Stage, "forward", ledger.charged(Stage.forward))
    runner.clock = ledger.clock
    tree = runner.modes[1]
    assert budget_table(runner, tree, [1, 2], 0.25, 40) == {1: 2, 2: 2}
    assert budget_table(runner, tree, [1, 2], 1e6, 40) == {1: 4, 2: 8}
    assert budget_table(runner, tree, [1, 2], 0.0, 40) == {1: 0, 2: 0}


def test_bench_measures_each_batch_size(tmp_path, code_prompts):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": row["prompt"][:200]}) + "\n"
                               for i, row in enumerate(code_prompts[:3])))
    out = tmp_path / "bench.json"
    assert main(["bench", str(REPO / "recipes" / "tree.yaml"), "--prompts", str(prompts), "--max-new-tokens", "8",
                 "--batch", "1,2", "--baselines", "ar", "--json", str(out),
                 "--set", "serving.speculation=always"]) == 0  # (adaptive may choose plain steps throughout)
    report = json.loads(out.read_text())
    assert list(report["systems"]) == ["specgraph", "ar"] and report["batches"] == [1, 2]
    for name, by_batch in report["systems"].items():
        assert list(by_batch) == ["1", "2"]
        for result in by_batch.values():
            assert result["tokens_per_second"] > 0 and result["same_tokens_as_ar"] == 1.0  # greedy: exact
    assert report["systems"]["specgraph"]["2"]["nodes_per_step"] > 0 == report["systems"]["ar"]["2"]["nodes_per_step"]


def written_report(tmp_path, result: str, change=lambda report: None) -> tuple[dict, Path]:
    """A GPU run's `bench --batch` report from docs/results, changed by `change`, written to tmp_path."""
    report, path = json.loads((REPO / "docs" / "results" / result).read_text()), tmp_path / "batch.json"
    change(report)
    path.write_text(json.dumps(report))
    return report, path


def test_report_prints_a_batch_report_alone_and_merges_none(tmp_path, capsys):
    """`report` prints a `bench --batch` report given alone as bench printed it (and writes it back
    with --json); with another part it refuses in one line (batch reports are not merged)."""
    from specgraph.bench.batched import print_batched

    batch, path = written_report(tmp_path, "run111-llama-3-8b-policy.json")
    again = tmp_path / "again.json"
    print_batched(batch)
    printed = capsys.readouterr().out
    assert main(["report", str(path), "--json", str(again)]) == 0
    assert capsys.readouterr().out == printed and json.loads(again.read_text()) == batch
    assert main(["report", str(path), str(again)]) == 2
    err = capsys.readouterr().err
    assert err == (f"specgraph: error: report: {path} is a `bench --batch` report: batch reports are not merged (each "
                   "already holds all its prompts at every batch size); give it alone to print it\n")


def test_report_plots_a_batch_report_by_batch_size(tmp_path, monkeypatch):
    """The plot's points are the batch sizes as numbers, in order (the JSON's keys are strings: "32"
    sorted before "8" and was drawn as a category)."""
    import matplotlib.axes

    batch, path = written_report(tmp_path, "run108-llama-3-8b-always.json")
    drawn = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, x, y, **k: drawn.append((k["label"], list(x), list(y))) or plot(self, x, y, **k))
    assert main(["report", str(path), "--plot", str(tmp_path / "batch.png")]) == 0
    assert drawn == [(name, [1, 8, 32], [batch["systems"][name][b]["tokens_per_second"] for b in ("1", "8", "32")])
                     for name in ("specgraph", "ar")]
    assert (tmp_path / "batch.png").stat().st_size > 0


@pytest.mark.parametrize("damage, expected", [
    (lambda r: r.pop("device"), "has no device (str)"),
    (lambda r: r["systems"].pop("specgraph"), "has no 'specgraph' system"),
    (lambda r: r["systems"]["ar"].pop("8"), "system 'ar' was not measured at specgraph's batch sizes"),
    (lambda r: r["systems"]["ar"]["8"].pop("ttft_seconds"), "system 'ar' at batch 8 has no ttft_seconds"),
    (lambda r: r["systems"]["ar"]["8"].update(tokens_per_second=0), "system 'ar' at batch 8 has tokens_per_second 0"),
])
def test_a_damaged_batch_report_is_one_line(tmp_path, capsys, damage, expected):
    _, path = written_report(tmp_path, "run108-llama-3-8b-always.json", damage)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specgraph: error: report: {path}") and expected in err and err.count("\n") == 1
    assert err.endswith("the batch report is damaged; rerun its bench\n")


def test_the_engine_is_measured_after_an_untimed_pass_where_newcomers_join_a_running_batch(target_reference):
    """measure_engine first decodes 2B prompts at most B at a time (so that newcomers join a running
    batch one by one before timing, as they do in the timed pass), then every prompt, timed."""
    from specgraph.bench.batched import measure_engine

    program = Program.from_recipe(two_stage(EMBEDDED / "target", None, serving={"max_batch": 2}))
    engine, admitted = program.executor, []
    add = engine.add_request
    engine.add_request = lambda ids, budget: admitted.append(ids) or add(ids, budget)
    encoded = [ids for ids, _ in target_reference[:5]]
    result = measure_engine(engine, encoded, 4, 2, lambda: None)
    assert admitted == encoded[:4] + encoded  # untimed: the first 4; timed: all 5
    assert result["outputs"] == [new[:4] for _, new in target_reference[:5]]


def test_a_prompt_forward_projects_no_logits(target_reference):
    """A prompt forward writes the K/V of its tokens and nothing reads its logits: neither the target
    nor the drafter projects a prompt chunk onto the vocabulary (Stage.feed); the steps do, and the
    tokens are transformers'."""
    program = Program.from_recipe(two_stage(EMBEDDED / "target", EMBEDDED / "draft", TREES["static"]))
    projected = []  # (stage, tokens) of each vocabulary projection
    for name, stage in program.stages.items():
        model, project = stage.model, stage.model.logits
        model.logits = lambda x, delta, name=name, project=project: projected.append((name, x.shape[1])) or project(x, delta)
    ids, expected = target_reference[0]
    assert len(ids) > 100 and program.generate(ids, max_new_tokens=8).output_ids == expected[:8]
    assert {name for name, _ in projected} == {"draft", "target"}
    assert max(tokens for _, tokens in projected) < 20, projected
