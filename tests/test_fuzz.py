"""A seeded fuzz of the command line: random recipe fields (valid and not: tree shapes, devices,
rules, sampling values at their edges), random prompt files and random flags. Every case either
runs — and, where it is greedy, gives the target's own greedy tokens — or exits 2 with one line;
never a traceback, never a hang (each case has a time limit). One-process recipes only: the
multi-process paths have their own tests."""

import json
import random
import signal

import pytest
from conftest import REPO

from specgraph.cli import build_parser, main, read_prompts
from specgraph.program import Program
from specgraph.recipe import Recipe

DEMO = REPO / "recipes" / "demo.yaml"
CASES = 200
SECONDS_PER_CASE = 60

# (valid values, invalid values) of each field a case may set; an invalid one is taken one time in ten
TREES = (["{shape: chain, length: %d}" % n for n in (1, 3, 6)]
         + ["{shape: static, branching: [2, 2]}", "{shape: static, branching: [3, 1, 1, 1]}",
            "{shape: static, paths: [[0], [1], [0, 0]]}", "{shape: dynamic, width: 2, depth: 3, nodes: 6}",
            "{shape: dynamic, width: 1, depth: 1, nodes: 1}"],
         ["{shape: chain, length: 0}", "{shape: static, branching: []}", "{shape: static, paths: [[1]]}",
          "{shape: static, paths: [[0], [0, 1]]}", "{shape: dynamic, width: 3, depth: 2, nodes: 99}", "{shape: spiral}",
          "{shape: dynamic, width: -1}", "[1, 2]"])
SETTINGS = {
    "stages.0.devices": (["[cpu]", "[auto]"], ["[cuda:0]", "[gpu]", "[]", "cpu"]),
    "stages.1.verify.rule": (["greedy", "sampling", "typical"], ["exact"]),
    "sampling.temperature": (["0", "0.001", "0.7", "5.0"], ["-1", "hot"]),
    "sampling.top_p": (["0.000001", "0.5", "1"], ["0", "1.5"]),
    "sampling.top_k": (["0", "1", "4", "5000"], ["-1"]),
    "sampling.seed": (["0", "7", "-3"], []),
    "max_seq_len": (["32", "64", "512"], ["0"]),
    "execution": (["serial"], ["sideways"]),
    "lowering.kernels": (["reference", "auto"], ["fast"]),
    "stages.0.grow": ([], ["{steps: 2}"]),
    "unknown.key": ([], ["1"]),
    "stages.7.name": ([], ["x"]),
}
PROMPT_LINES = (['{"prompt": "import os\\n"}', '{"id": "b", "prompt": "def parse(path):\\n"}', "",
                 '{"prompt": "' + "x = 1\\n" * 40 + '"}'],
                ["{not json}", '{"text": "no prompt key"}', '{"prompt": 5}'])


def pick(rng: random.Random, choices: tuple[list, list]):
    valid, invalid = choices
    return rng.choice(invalid if invalid and (not valid or rng.random() < 0.1) else valid)


def random_case(rng: random.Random, tmp_path, n: int) -> list[str]:
    argv = ["run", str(DEMO), "--json", str(tmp_path / f"out{n}.json")]
    if rng.random() < 0.7:
        argv += ["--set", f"stages.0.tree={pick(rng, TREES)}"]
    for key in rng.sample(sorted(SETTINGS), rng.randint(0, 4)):
        if SETTINGS[key][0] or rng.random() < 0.2:
            argv += ["--set", f"{key}={pick(rng, SETTINGS[key])}"]
    kind = rng.random()
    if kind < 0.5:
        argv += ["--prompt", rng.choice(["import os\n", "class Tree:\n", "é∂ unicode ✓\n", " ", "x" * 300])]
    elif kind < 0.9:
        prompts = tmp_path / f"p{n}.jsonl"
        prompts.write_text("\n".join(pick(rng, PROMPT_LINES) for _ in range(rng.randint(0, 3))) + "\n")
        argv += ["--prompts", str(prompts)]
    else:
        prompts = tmp_path / f"p{n}.jsonl"
        prompts.write_bytes(b'{"prompt": "\xff\xfe"}\n')
        argv += ["--prompts", str(prompts)]
    argv += ["--max-new-tokens", str(pick(rng, ([1, 2, 5, 8], [0, -3])))]
    if rng.random() < 0.2:
        argv += ["--threads", str(rng.choice([1, 2, 0]))]
    if rng.random() < 0.1:
        argv += [rng.choice(["--no-cuda-graphs", "--bogus-flag", "--program"])]
    return argv


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout


@pytest.fixture(scope="module")
def target_alone():
    """Our autoregressive decoding of the target (equal to transformers' greedy output: test_greedy_equivalence)."""
    return Program.from_recipe(Recipe.from_yaml(REPO / "recipes" / "autoregressive.yaml"))


def expected_tokens(program: Program, argv: list[str], settings: dict) -> dict[str, list[int]]:
    """The target's own greedy continuation of each prompt the case names, by prompt id."""
    args = build_parser().parse_args(argv)
    prompts = read_prompts(args, Recipe.from_yaml(DEMO).prompt)
    max_seq_len = int(settings.get("max_seq_len", 2048))
    out = {}
    for row in prompts:
        ids = program.encode(row["prompt"])
        if 0 < len(ids) < max_seq_len:
            out[row["id"]] = program.generate(ids, min(args.max_new_tokens, max_seq_len - len(ids))).output_ids
    return out


def test_every_random_case_runs_exactly_or_fails_in_one_line(tmp_path, capsys, target_alone):
    rng = random.Random(20261130)
    outcomes = {0: 0, 2: 0}
    compared = 0
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for n in range(CASES):
            argv = random_case(rng, tmp_path, n)
            signal.alarm(SECONDS_PER_CASE)
            try:
                status = main(argv)
            except SystemExit as exc:  # argparse's error (our parser prints one line first)
                status = exc.code
            except Timeout:
                pytest.fail(f"case {n} hung: {argv}")
            finally:
                signal.alarm(0)
            err = capsys.readouterr().err
            assert status in (0, 2), (n, argv, err)
            assert "Traceback" not in err, (n, argv, err)
            outcomes[status] += 1
            if status == 2:
                assert err.strip().splitlines()[-1].startswith("specgraph: error: "), (n, argv, err)
                continue
            settings = dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))
            greedy = (float(settings.get("sampling.temperature", 0)) == 0
                      and settings.get("stages.1.verify.rule", "greedy") in ("greedy", "typical"))
            if greedy:
                expected = expected_tokens(target_alone, argv, settings)
                for result in json.loads((tmp_path / f"out{n}.json").read_text())["results"]:
                    assert result["output_ids"] == expected[result["id"]], (n, argv)
                    compared += 1
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert outcomes[0] >= 40 and outcomes[2] >= 40 and compared >= 20, (outcomes, compared)  # all were exercised
