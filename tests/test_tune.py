"""specgraph tune: the choice against hand-made measurements whose answer is known by construction,
the candidate grid, tuned recipes (the demo pair and the hybrid target) that load from their own
folder and decode exactly the target's greedy tokens, and one-line errors."""

import json
import re

import pytest
from conftest import EMBEDDED, REPO, SHIPPED_PROMPTS, shared_model
from helpers import hf_greedy

from specgraph.bench.tune import Candidate, Measurement, bole_candidates, choose, grid
from specgraph.errors import SpecgraphError
from specgraph.cli import main
from specgraph.program import Program
from specgraph.recipe import DynamicTree, Recipe

DEMO = REPO / "recipes" / "demo.yaml"
TINY = ["--max-prompts", "2", "--max-new-tokens", "16", "--widths", "1,2", "--depths", "2", "--nodes", "2,4"]


def measured(width, depth, nodes, accepted, draft_ms, verify_ms) -> Measurement:
    return Measurement(Candidate(width, depth, nodes), accepted, draft_ms / 1e3, verify_ms / 1e3, 0.0)


# A one-token forward takes 10 ms. Expected tokens/s = accepted / (draft + verify), worked out by hand:
CHEAP = measured(1, 2, 2, 2.0, 2.0, 10.5)  # 2 / 12.5 ms = 160.0; epsilon 0.05
BEST = measured(2, 2, 4, 3.0, 1.0, 11.0)  # 3 / 12 ms = 250.0; epsilon 0.1
SAME_SIZE = measured(4, 2, 4, 2.5, 1.0, 11.0)  # 2.5 / 12 ms = 208.3; epsilon 0.1
MIDDLE = measured(2, 3, 8, 3.5, 1.0, 15.0)  # 3.5 / 16 ms = 218.75; epsilon 0.5
HUGE = measured(4, 4, 16, 5.0, 2.0, 30.0)  # 5 / 32 ms = 156.25; epsilon 2.0
ALL = [CHEAP, BEST, SAME_SIZE, MIDDLE, HUGE]


def test_estimates_and_epsilons_are_the_hand_computed_ones():
    assert [round(m.tokens_per_second, 2) for m in ALL] == [160.0, 250.0, 208.33, 218.75, 156.25]
    assert [round(m.epsilon(0.010), 6) for m in ALL] == [0.05, 0.1, 0.1, 0.5, 2.0]


def test_throughput_rule_takes_the_highest_estimate():
    chosen, reason = choose(list(reversed(ALL)), 0.010, "throughput")
    assert chosen is BEST
    assert "250.0" in reason and "next: w2 d3 n8, 218.8" in reason and "target alone: 100.0" in reason
    alone_is_faster, reason = choose(ALL, 0.001, "throughput")  # a one-token forward of 1 ms: 1000 tokens/s alone
    assert alone_is_faster is BEST and "none beats the target alone" in reason


@pytest.mark.parametrize("epsilon, expected", [
    (0.1, BEST),  # n = 4 is the largest within 1.1 one-token forwards; of the two of that size, the faster
    (0.6, MIDDLE),  # n = 8 costs 1.5
    (5.0, HUGE),  # everything fits: the largest
])
def test_bole_rule_takes_the_largest_tree_within_the_budget(epsilon, expected):
    chosen, reason = choose(ALL, 0.010, "bole", epsilon)
    assert chosen is expected
    assert f"the largest tree ({expected.candidate.nodes} nodes)" in reason
    assert f"(it costs {1 + expected.epsilon(0.010):.2f})" in reason


def test_bole_rule_says_why_when_no_tree_fits():
    chosen, reason = choose(ALL, 0.010, "bole", 0.01)
    assert chosen is None
    assert "no candidate verifies within 1.01 one-token forwards" in reason and "the cheapest, w1 d2 n2, costs 1.05" in reason


def test_bole_candidates_are_the_largest_trees_within_the_budget_known_before_any_drafting():
    verify = {1: 0.010, 3: 0.0105, 5: 0.011, 9: 0.015}  # T tokens -> seconds
    candidates = [Candidate(1, 2, 2), Candidate(2, 2, 4), Candidate(4, 2, 4), Candidate(2, 3, 8)]
    assert bole_candidates(candidates, verify, 0.1) == [Candidate(2, 2, 4), Candidate(4, 2, 4)]
    assert bole_candidates(candidates, verify, 0.5) == [Candidate(2, 3, 8)]
    with pytest.raises(SpecgraphError, match=r"no candidate verifies within 1.01 one-token forwards \(--epsilon 0.01\): "
                                             r"the cheapest, w1 d2 n2, costs 1.05"):
        bole_candidates(candidates, verify, 0.01)


def test_tune_by_bole_rule_stops_before_measuring_drafts_when_no_tree_fits(tmp_path, capsys):
    """The budget is checked once verification is timed: no candidate is decoded, nothing is written."""
    out = tmp_path / "tuned.yaml"
    assert main(["tune", str(DEMO), "--prompts", str(SHIPPED_PROMPTS), "-o", str(out), "--max-prompts", "1",
                 "--max-new-tokens", "16", "--widths", "4", "--depths", "2", "--nodes", "8,16",
                 "--rule", "bole", "--epsilon", "1e-9"]) == 2
    err = capsys.readouterr().err
    assert "specgraph: error: --rule bole: no candidate verifies within" in err
    assert "accepted/step" not in err and not out.exists()


def test_grid_cuts_node_counts_to_what_a_tree_grows_and_to_max_nodes():
    assert grid([1, 2], [2, 3], [2, 4, 64], 8) == [
        Candidate(1, 2, 2), Candidate(1, 3, 3),  # width 1 grows a chain: nodes = depth
        Candidate(2, 2, 2), Candidate(2, 2, 4), Candidate(2, 2, 6),  # width 2, depth 2: at most 2 + 4 nodes
        Candidate(2, 3, 4), Candidate(2, 3, 8),  # depth 3 with 2 nodes is deeper than its node count; 64 -> max 8
    ]


def test_a_tuned_recipe_keeps_its_other_fields_and_resolves_its_paths_from_its_own_folder(tmp_path):
    original = Recipe.from_yaml(REPO / "recipes" / "hybrid.yaml", ["sampling.temperature=0.5"])
    tuned = original.with_tree(0, DynamicTree(shape="dynamic", width=3, depth=2, nodes=5))
    out = tmp_path / "deeper" / "tuned.yaml"
    out.parent.mkdir()
    out.write_text(tuned.to_yaml(out.parent))
    loaded = Recipe.from_yaml(out)
    assert {k: m.path.resolve() for k, m in loaded.models.items()} == {k: m.path.resolve() for k, m in original.models.items()}
    assert loaded.model_copy(update={"models": tuned.models}) == tuned
    assert "lowering" not in out.read_text()  # defaults stay unwritten


def tune_and_run(recipe, out, tmp_path, capsys, *flags, measured=("w1 d2 n2", "w2 d2 n2", "w2 d2 n4")
                 ) -> tuple[dict, list[list[int]], dict[str, str]]:
    """`specgraph tune` with a tiny grid, then `specgraph run` of the tuned recipe on the first two
    prompts: (the tuned recipe's drafting tree, the output ids of each prompt, each candidate's mean
    accepted length as tune printed it). `measured`: the candidates whose drafting tune measures."""
    assert main(["tune", str(recipe), "--prompts", str(SHIPPED_PROMPTS), "-o", str(out), *TINY, *flags]) == 0
    captured = capsys.readouterr()
    accepted = {}
    for number, candidate in enumerate(measured, start=1):
        line = re.search(rf"{number}/{len(measured)} {candidate}: ([\d.]+) accepted/step", captured.err)
        assert line is not None  # progress, as each candidate is measured
        accepted[candidate] = line[1]
    chosen = re.search(r"chosen \((\w+) rule\): w(\d+) d(\d+) n(\d+), measured epsilon (-?[\d.]+)", captured.out)
    assert chosen is not None and f"wrote {out}" in captured.out
    tree = Recipe.from_yaml(out).stages[0].tree
    assert tree == DynamicTree(width=int(chosen[2]), depth=int(chosen[3]), nodes=int(chosen[4]))
    assert out.read_text().startswith(f"# {Recipe.from_yaml(recipe).name}, tuned by `specgraph tune` ({chosen[1]} rule)")
    assert f"epsilon {chosen[5]}" in out.read_text().splitlines()[0]
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join(SHIPPED_PROMPTS.read_text().splitlines(keepends=True)[:2]))
    result = tmp_path / "run.json"
    assert main(["run", str(out), "--prompts", str(prompts), "--max-new-tokens", "32", "--json", str(result)]) == 0
    return tree, [r["output_ids"] for r in json.loads(result.read_text())["results"]], accepted


def test_tune_the_demo_pair_and_run_it_exactly(tmp_path, capsys, code_prompts):
    out = tmp_path / "elsewhere" / "tuned.yaml"  # in another folder than the recipe: its model paths are rewritten
    out.parent.mkdir()
    tree, outputs, accepted = tune_and_run(DEMO, out, tmp_path, capsys)
    demo = Recipe.from_yaml(DEMO, ["serving.speculation=always"])
    for candidate, printed in accepted.items():  # each candidate's tree in every step: as a recipe of it decodes
        w, d, n = map(int, re.findall(r"\d+", candidate))
        program = Program.from_recipe(demo.with_tree(0, DynamicTree(width=w, depth=d, nodes=n)))
        steps = [k for row in code_prompts[:2] for k in program.generate(program.encode(row["prompt"]), 16).accepted_lengths]
        assert printed == f"{sum(steps) / len(steps):.2f}", candidate
    assert Candidate(tree.width, tree.depth, tree.nodes) in grid([1, 2], [2], [2, 4], 64)
    tuned, demo = Recipe.from_yaml(out), Recipe.from_yaml(DEMO)
    assert tuned.model_copy(update={"models": demo.models}) == demo.with_tree(0, tree)  # only the tree changed
    assert outputs == [new for _, new in hf_greedy(EMBEDDED / "target", code_prompts[:2], 32)]


def test_tune_a_hybrid_target_by_bole_rule_and_run_it_exactly(tmp_path, capsys, code_prompts):
    hybrid = shared_model("hybrid")
    out = tmp_path / "tuned.yaml"
    # a budget every candidate meets: the largest tree of the grid, whatever this machine measures; on the CPU
    # (fp32, exact), which the tuned recipe keeps
    on_cpu = ["--set", "stages.0.devices=[cpu]", "--set", "stages.1.devices=[cpu]"]
    tree, outputs, _ = tune_and_run(REPO / "recipes" / "hybrid.yaml", out, tmp_path, capsys, "--rule", "bole",
                                 "--epsilon", "100", *on_cpu, measured=("w2 d2 n4",))  # the largest within it
    assert tree == DynamicTree(width=2, depth=2, nodes=4)
    assert [s.devices for s in Recipe.from_yaml(out).stages] == [["cpu"], ["cpu"]]
    assert outputs == [new for _, new in hf_greedy(hybrid, code_prompts[:2], 32)]


@pytest.mark.parametrize("args, expected", [
    (["--set", "execution=disaggregated"], "tune: execution 'disaggregated' cannot be tuned yet (tune measures the "
                                           "serial executor's steps); valid: serial"),
    (["--prompts", "none.jsonl"], "--prompts: none.jsonl does not exist"),
    (["--widen", "llama-9b"], "--widen: unknown shape 'llama-9b'; valid: llama-3.2-1b, llama-3.2-3b, llama-3-8b, "
                              "llama-3-70b, qwen3.5-9b, qwen3.5-27b"),
    (["--rule", "bole", "--epsilon", "0"], "--epsilon: must be > 0 (got 0.0)"),
    (["--rule", "bole", "--epsilon", "-0.5"], "--epsilon: must be > 0 (got -0.5)"),
    (["--epsilon", "0.1"], "--epsilon: it is the budget of --rule bole; give both, or neither"),
    (["--widths", "1,two"], "--widths: expected whole numbers of at least 1, comma-separated, e.g. 1,2,4 (got '1,two')"),
    (["--nodes", "0"], "--nodes: expected whole numbers of at least 1"),
    (["--max-nodes", "0"], "--max-nodes: must be at least 1 (got 0)"),
    (["--max-prompts", "0"], "--max-prompts: must be at least 1 (got 0)"),
    (["--depths", "8", "--nodes", "4"], "--depths: every candidate is deeper than its node count"),
    (["--depths", "4", "--max-new-tokens", "10"], "--max-new-tokens: 10 is too few to measure trees 4 deep"),
])
def test_bad_input_exits_with_one_line(args, expected, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os\\n"}\n')
    assert main(["tune", str(DEMO), "--prompts", str(prompts), "-o", str(tmp_path / "t.yaml"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specgraph: error: ") and expected in err[-1], err
    assert not any("Traceback" in line for line in err) and not (tmp_path / "t.yaml").exists()


def test_a_recipe_without_a_drafter_an_output_folder_or_a_known_rule_is_refused(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os\\n"}\n')
    with pytest.raises(SystemExit) as exit:  # (argparse's refusals exit from the parser)
        main(["tune", str(DEMO), "--prompts", str(prompts), "-o", str(tmp_path / "t.yaml"), "--rule", "fastest"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.startswith("specgraph: error: tune: argument --rule: invalid choice: 'fastest'")
    alone = REPO / "recipes" / "autoregressive.yaml"
    assert main(["tune", str(alone), "--prompts", str(prompts), "-o", str(tmp_path / "t.yaml")]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "tune: recipe autoregressive has no drafting stage (stage target decodes alone); tune sizes a drafter's tree: "
        "give a recipe with a drafter and a target that verifies it")
    assert main(["tune", str(DEMO), "--prompts", str(prompts), "-o", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"specgraph: error: -o: {tmp_path} is a folder; give a file path"
