"""A seeded fuzz of the command line: random recipe fields (valid and not: tree shapes, devices,
rules, sampling values at their edges), random prompt files and random flags. Every case either
runs — and, where it is greedy, gives the target's own greedy tokens — or exits 2 with one line;
never a traceback, never a hang (each case has a time limit). One-process recipes only: the
multi-process paths have their own tests. Then every command's output pointed at every kind of
place (symlinks, devices, FIFOs, unwritable folders): the output lands where the user meant, or
the command exits 2 with one line and the place is as it was."""

import json
import os
import random
import signal
import stat

import pytest
from conftest import REPO
from helpers import character_device, read_fifo, unwritable_folder
from test_report import part

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


@pytest.fixture
def timed_main():
    """main(argv)'s exit status, failing the test when a case runs past SECONDS_PER_CASE."""
    previous = signal.signal(signal.SIGALRM, _alarm)

    def run(argv: list[str]) -> int:
        signal.alarm(SECONDS_PER_CASE)
        try:
            return main(argv)
        except SystemExit as exc:  # argparse's error (our parser prints one line first)
            return exc.code
        except Timeout:
            pytest.fail(f"hung: {argv}")
        finally:
            signal.alarm(0)

    yield run
    signal.signal(signal.SIGALRM, previous)


def test_every_random_case_runs_exactly_or_fails_in_one_line(tmp_path, capsys, target_alone, timed_main):
    rng = random.Random(20261130)
    outcomes = {0: 0, 2: 0}
    compared = 0
    for n in range(CASES):
        argv = random_case(rng, tmp_path, n)
        status = timed_main(argv)
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
    assert outcomes[0] >= 40 and outcomes[2] >= 40 and compared >= 20, (outcomes, compared)  # all were exercised


# Each command that writes an output: its command line given a report part and the output path,
# the output's suffix, and what its bytes must satisfy
OUTPUTS = {
    "inspect --dot": (lambda part, out: ["inspect", str(DEMO), "--dot", out], ".dot",
                      lambda data: data.startswith(b"digraph")),
    "report --json": (lambda part, out: ["report", part, "--json", out], ".json",
                      lambda data: list(json.loads(data)["systems"]) == ["specgraph", "ar"]),
    "report --plot": (lambda part, out: ["report", part, "--plot", out], ".png",
                      lambda data: data.startswith(b"\x89PNG\r\n\x1a\n")),
    "run --json": (lambda part, out: ["run", str(DEMO), "--prompt", "import os\n", "--max-new-tokens", "2",
                                      "--json", out], ".json",
                   lambda data: len(json.loads(data)["results"][0]["output_ids"]) == 2),
}
PLACES = ("new file", "existing file", "symlink to a file", "dangling symlink", "symlink into a missing folder",
          "symlink to a folder", "character device", "full device", "FIFO", "file as folder", "unwritable folder",
          "missing folder", "folder")


def output_place(kind: str, folder, suffix: str):
    """A place of `kind` made in `folder` for an output named with `suffix`: the path to give, and
    the file the output must land in (None where the command must refuse it)."""
    elsewhere = folder / "elsewhere"
    elsewhere.mkdir()
    path = folder / f"out{suffix}"
    if kind == "new file":
        return path, path
    if kind == "existing file":
        path.write_text("old")
        path.chmod(0o640)
        return path, path
    if kind == "symlink to a file":
        (elsewhere / f"t{suffix}").write_text("old")
        path.symlink_to(elsewhere / f"t{suffix}")
        return path, elsewhere / f"t{suffix}"
    if kind == "dangling symlink":  # its folder exists: the write creates the file it names
        path.symlink_to(elsewhere / f"new{suffix}")
        return path, elsewhere / f"new{suffix}"
    if kind == "symlink into a missing folder":
        path.symlink_to(folder / "missing" / f"x{suffix}")
        return path, None
    if kind == "symlink to a folder":
        path.symlink_to(elsewhere)
        return path, None
    if kind in ("character device", "full device"):  # written into: null takes it all, full fails with ENOSPC
        device = character_device(folder, "null" if kind == "character device" else "full", f"device{suffix}")
        return device, device if kind == "character device" and device.suffix == suffix else None
    if kind == "FIFO":
        os.mkfifo(path)
        return path, path
    if kind == "file as folder":
        (folder / "a.txt").write_text("mine")
        return folder / "a.txt" / f"out{suffix}", None
    if kind == "unwritable folder":
        return unwritable_folder(folder)[0] / f"out{suffix}", None
    if kind == "missing folder":
        return folder / "missing" / f"out{suffix}", None
    assert kind == "folder"
    return elsewhere, None


def snapshot(folder) -> dict:
    """Every entry under `folder`, symlinks not followed: its type, mode and inode, a link's target,
    a file's bytes."""
    entries = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            content = (os.readlink(path) if stat.S_ISLNK(st.st_mode)
                       else open(path, "rb").read() if stat.S_ISREG(st.st_mode) else None)
            entries[path] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_ino, content)
    return entries


def test_every_output_lands_where_meant_or_fails_in_one_line(tmp_path, capsys, timed_main):
    report = tmp_path / "part.json"
    report.write_text(json.dumps(part()))
    umask = os.umask(0o022)
    os.umask(umask)
    for n, (command, kind) in enumerate((c, k) for c in OUTPUTS for k in PLACES):
        argv_of, suffix, good = OUTPUTS[command]
        folder = tmp_path / f"case{n}"
        folder.mkdir()
        path, lands = output_place(kind, folder, suffix)
        before = snapshot(folder)
        mode = stat.S_IMODE(os.stat(lands).st_mode) if lands is not None and lands.exists() else 0o666 & ~umask
        received = read_fifo(path) if kind == "FIFO" else None
        status = timed_main(argv_of(str(report), str(path)))
        err = capsys.readouterr().err
        case = (n, command, kind, path, err)
        assert "Traceback" not in err and status == (2 if lands is None else 0), case
        after = snapshot(folder)
        if lands is None:  # refused in one line, everything as it was
            assert err.strip().splitlines()[-1].startswith("specgraph: error: ") and after == before, case
            assert received is None or received() == b"", case
            continue
        if received is not None:
            assert good(received()) and stat.S_ISFIFO(os.lstat(path).st_mode), case
        elif stat.S_ISREG(os.stat(lands).st_mode):
            assert good(lands.read_bytes()) and stat.S_IMODE(os.stat(lands).st_mode) == mode, case
            before.pop(str(lands), None)
            after.pop(str(lands))
        assert after == before, case  # the link, the device, the FIFO unchanged; no temporary file left
        assert stat.S_ISCHR(os.stat(path).st_mode) or kind != "character device", case
