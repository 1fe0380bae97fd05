"""The disaggregated executor (SwiftSpec): drafter and target in processes of their own, messages
between them over torch.distributed (gloo on the CPU). Its greedy output equals transformers'
greedy output of the target on the fixtures (16 held-out prompts x 128 new tokens); its sampled
output follows the target's distribution; faults end the run in one line with no process left."""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import EMBEDDED, REPO, shared_model
from helpers import (ORACLE_TOKENS, PROMPT, Alone, children, descendants, fault_ends_the_run, gone, hf_greedy,
                     interruptible, running, splittable_recipe, two_stage)

from specgraph.program import Program
from specgraph.recipe import Recipe

DYNAMIC = {"shape": "dynamic", "width": 4, "depth": 5, "nodes": 24}


def disaggregated(target, draft, tree, **fields) -> Recipe:
    return two_stage(target, draft, tree, execution="disaggregated", **fields)


@pytest.mark.parametrize("target, drafter, tree", [
    ("target", "draft", DYNAMIC),
    ("target", "mid", {"shape": "chain", "length": 4}),
    ("hybrid", "draft", DYNAMIC),
], ids=["dynamic-draft", "chain-mid", "hybrid-dynamic"])
def test_greedy_output_equals_the_target_alone(target, drafter, tree, request):
    reference = request.getfixturevalue("hybrid_reference" if target == "hybrid" else "target_reference")
    target_path = shared_model("hybrid") if target == "hybrid" else EMBEDDED / "target"
    draft_path = EMBEDDED / "draft" if drafter == "draft" else shared_model("mid")
    accepted, survived, rounds = [], 0, 0
    with Program.from_recipe(disaggregated(target_path, draft_path, tree, max_new_tokens=128)) as program:
        for ids, expected in reference:
            generation = program.generate(ids)
            assert generation.output_ids == expected
            accepted += generation.accepted_lengths
            survived, rounds = survived + generation.stats["survived"], rounds + generation.stats["rounds"]
    assert sum(accepted) / len(accepted) > 1.5  # the drafts are really being accepted
    assert rounds == len(accepted) and 0 < survived < rounds  # trees re-rooted with their subtree, and restarted


def test_static_trees_and_typical_acceptance_through_the_executor(target_reference):
    """A static tree (drafted anew after each verdict) is exact; typical acceptance at temperature 0
    accepts only the target's argmax, so it is exact too."""
    for tree, verify in (({"shape": "static", "branching": [3, 2, 1]}, {"rule": "greedy"}), (DYNAMIC, {"rule": "typical"})):
        recipe = disaggregated(EMBEDDED / "target", EMBEDDED / "draft", tree, max_new_tokens=48)
        recipe = recipe.model_copy(update={"stages": [recipe.stages[0], recipe.stages[1].model_copy(
            update={"verify": recipe.stages[1].verify.model_copy(update=verify)})]})
        with Program.from_recipe(recipe) as program:
            for ids, expected in target_reference[:4]:
                assert program.generate(ids).output_ids == expected[:48]


def test_a_hybrid_drafter_drafts_static_trees_for_a_hybrid_target(small_hybrid, hybrid_reference):
    """A small hybrid drafter (drafting each static tree anew after the verdict, its recurrent state
    folded along the accepted path) in its own process: the hybrid target's own greedy output."""
    recipe = disaggregated(shared_model("hybrid"), small_hybrid, {"shape": "static", "branching": [3, 2, 1]},
                           max_new_tokens=48)
    accepted = []
    with Program.from_recipe(recipe) as program:
        for ids, expected in hybrid_reference[:3]:
            generation = program.generate(ids)
            assert generation.output_ids == expected[:48]
            accepted += generation.accepted_lengths
    assert sum(accepted) / len(accepted) > 1.2


def test_a_tensor_parallel_target_with_a_one_process_drafter(tmp_path, target_reference):
    """Three processes: the target split over two (gloo all-reduces in its own group), the drafter in
    a third. The fixtures' heads do not split in two, so both are widened (same function) to 6 query
    heads over 2 KV heads: the output is still transformers' greedy output of the target fixture."""
    recipe = Recipe.from_yaml(splittable_recipe(tmp_path), ["execution=disaggregated", "stages.0.tree={shape: dynamic}",
                                                            "stages.1.devices=[cpu,cpu]", "max_new_tokens=128"])
    with Program.from_recipe(recipe) as program:
        assert len(program.cluster.pids) == 3
        for ids, expected in target_reference[:6]:  # three processes a step: the serial tests take all prompts
            assert program.generate(ids).output_ids == expected


def test_the_swiftspec_layouts_plan_on_eight_gpus_and_the_four_gpu_one_decodes_on_cpu_ranks(monkeypatch,
                                                                                             target_reference):
    """recipes/swiftspec-{4,8}gpu.yaml: the target over 3 (6) GPUs, the drafter over the rest, each
    stage its own group; the 4-GPU layout on four CPU processes (the fixture's 3 query heads a rank
    each, the drafter alone) decodes transformers' greedy tokens."""
    import sys as _sys

    from specgraph.passes import plan

    monkeypatch.setattr(_sys.modules["specgraph.passes.place"], "present_devices",
                        lambda: ["cpu"] + [f"cuda:{i}" for i in range(8)])
    for name, target, draft in (("swiftspec-4gpu", 3, 1), ("swiftspec-8gpu", 6, 2)):
        graph = plan(Recipe.from_yaml(REPO / "recipes" / f"{name}.yaml"))
        assert (graph.node("target")["tp"], graph.node("draft")["tp"]) == (target, draft)
    monkeypatch.undo()
    recipe = Recipe.from_yaml(REPO / "recipes" / "swiftspec-4gpu.yaml", [
        "stages.0.devices=[cpu]", "stages.1.devices=[cpu,cpu,cpu]", "max_new_tokens=32",
        "models.target.dtype=float32", "models.draft.dtype=float32"])
    with Program.from_recipe(recipe) as program:
        assert len(program.cluster.pids) == 4
        for ids, expected in target_reference[:2]:
            assert program.generate(ids).output_ids == expected[:32]


def test_a_row_invariant_tensor_parallel_target_decodes_the_target_alone(tmp_path):
    """lowering.row_invariant with the target over two ranks (the invariant kernels, interpreted,
    in its worker processes; a short prompt): transformers' greedy tokens of the (widened) target."""
    recipe = Recipe.from_yaml(splittable_recipe(tmp_path), [
        "execution=disaggregated", "stages.1.devices=[cpu,cpu]", f"max_new_tokens={ORACLE_TOKENS}",
        "lowering={kernels: reference, row_invariant: true}"])
    [(ids, expected)] = hf_greedy(tmp_path / "target", [{"prompt": PROMPT}], ORACLE_TOKENS)
    with Program.from_recipe(recipe) as program:
        assert program.generate(ids).output_ids == expected


def test_sampling_through_the_executor_draws_the_target_alone_tokens_seed_for_seed():
    """Two sampled tokens after a prompt over 100 seeds (temperature 1, top-k 3, a dynamic tree): each
    seed's are the target alone's in transformers (helpers.Alone: the keyed Gumbel-max over its own
    logits), so they follow its law (tests/test_seeded.py checks that law over seeds), not the draft's."""
    sampling = {"temperature": 1.0, "top_k": 3}
    recipe = disaggregated(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "dynamic", "width": 2, "depth": 2, "nodes": 4},
                           sampling=sampling, max_new_tokens=2)
    alone = Alone(EMBEDDED / "target")
    with Program.from_recipe(recipe) as program:
        ids = program.encode("import os\nimport sys\n\n\ndef main(")
        drawn = [program.generate(ids, seed=seed).output_ids for seed in range(100)]
    assert drawn == [alone.sample(ids, 2, seed, **sampling) for seed in range(100)]
    assert len(set(map(tuple, drawn))) > 3  # (seeds draw different tokens)


def test_killing_a_worker_ends_the_run_with_one_line_and_no_process_left():
    recipe = disaggregated(EMBEDDED / "target", EMBEDDED / "draft", DYNAMIC, max_new_tokens=2000, max_seq_len=2048)
    program = Program.from_recipe(recipe)
    fault_ends_the_run(program, program.cluster.pids[1], signal.SIGKILL, r"^stage draft rank 1 was killed by signal 9 \(SIGKILL\)$")


def test_a_worker_that_stops_answering_ends_the_run_within_the_timeout():
    """SIGSTOP: the drafter hangs (its own watchdog cannot run); the target's names it."""
    recipe = disaggregated(EMBEDDED / "target", EMBEDDED / "draft", DYNAMIC, max_new_tokens=2000, max_seq_len=2048,
                           timeout=2.0)
    program = Program.from_recipe(recipe)
    fault_ends_the_run(program, program.cluster.pids[1], signal.SIGSTOP, r"^stage target rank 0: waiting for a verdict|"
                       r"^stage target rank 0: waiting for a tree from stage draft \(rank 1\) for more than 2 s")


def disaggregated_recipe(tmp_path: Path) -> Path:
    """recipes/disaggregated.yaml with its models' paths made absolute, in tmp_path (for a subprocess)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text((REPO / "recipes" / "disaggregated.yaml").read_text().replace("models/", str(REPO / "recipes" / "models") + "/"))
    return recipe


def test_ctrl_c_stops_every_worker(tmp_path):
    recipe = disaggregated_recipe(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "specgraph", "run", str(recipe), "--prompt", PROMPT,
                             "--max-new-tokens", "2000", "--set", "max_seq_len=2048"],
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=interruptible)
    for line in proc.stderr:
        if "starting 2 processes" in line:
            break
    deadline = time.monotonic() + 60  # the ranks fork from a server that first imports specgraph
    while sum(len(children(child)) for child in children(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # the ranks load their stages and decode
    processes = descendants(proc.pid)  # the two ranks, the fork server they come from, the resource tracker
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    assert proc.wait(timeout=60) == 130  # (the limit only ends a hang)
    assert "specgraph: interrupted" in proc.stderr.read()
    assert len(processes) >= 3 and gone(processes), processes


def in_session(sid: int) -> dict[int, tuple[int, str]]:
    """The running processes of session `sid`: pid -> (parent pid, command line). A process keeps
    its session when its parent dies, where it is no longer a descendant of anyone we know."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline") as f:
                command = f.read().replace("\0", " ")
        except OSError:  # ended meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found[int(entry)] = (int(fields[1]), command)
    return found


def importing_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()  # mapped early in the import, about a second before it ends
    except OSError:
        return False


def fork_servers(processes: dict[int, tuple[int, str]]) -> set[int]:
    """The fork server and the ranks forked from it (they share its command line)."""
    return {pid for pid, (_, command) in processes.items() if "multiprocessing.forkserver" in command}


def forked_ranks(processes: dict[int, tuple[int, str]]) -> int:
    servers = fork_servers(processes)
    return sum(parent in servers for parent, _ in processes.values())


STARTING = {  # moments of a start to press Ctrl-C at: (client pid, its session's processes) -> reached
    "client-imports-torch": lambda client, processes: importing_torch(client),  # about a second in
    # its preload, seconds long (at its birth, before Python's own SIGINT handler, Ctrl-C kills it quietly)
    "fork-server-imports-torch": lambda client, processes: any(map(importing_torch, fork_servers(processes))),
    "ranks-load": lambda client, processes: forked_ranks(processes) >= 2,
}


@pytest.mark.parametrize("moment", STARTING)
def test_ctrl_c_while_the_program_starts_is_one_line_and_leaves_no_process(tmp_path, moment):
    """Ctrl-C (to the whole process group, as a terminal sends it) at a moment of `specgraph run`'s
    start: exit status 130, the one line and no traceback from any process, and within seconds no
    process of its session left, the fork server included (it imports specgraph, torch and
    transformers for seconds before its own main ignores SIGINT)."""
    recipe = disaggregated_recipe(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "specgraph", "run", str(recipe), "--prompt", PROMPT,
                             "--max-new-tokens", "2000", "--set", "max_seq_len=2048"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 120
        while not STARTING[moment](proc.pid, in_session(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, f"{moment} not reached"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)  # (until every process that holds its stderr has ended)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert err.splitlines()[-1:] == ["specgraph: interrupted"], err
        while in_session(proc.pid) and time.monotonic() < sent + 60:  # (the limit only ends a hang)
            time.sleep(0.1)
        assert not (left := in_session(proc.pid)), left
    finally:
        for pid in in_session(proc.pid):
            with contextlib.suppress(ProcessLookupError):  # (ended meanwhile)
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)


CLIENT = """
import os, sys
from specgraph.program import Program
from specgraph.recipe import Recipe

if __name__ == "__main__":
    program = Program.from_recipe(Recipe.from_yaml(sys.argv[1], ["max_new_tokens=2000", "max_seq_len=2048"]))
    ids = program.encode(sys.argv[2])
    program.generate(ids, 4)
    print(*program.cluster.pids, flush=True)
    program.generate(ids)
"""


def test_ranks_end_when_their_client_is_killed_mid_request(tmp_path):
    """SIGKILL on a client decoding a long request (nothing of it runs: no Ctrl-C handling, no close):
    its ranks end while a second client, started after it, is still decoding the same request (2000
    tokens: the target's greedy continuation of PROMPT has no EOS), so they did not wait for theirs."""
    recipe, script = disaggregated_recipe(tmp_path), tmp_path / "client.py"
    script.write_text(CLIENT)
    clients, ranks = [], []
    try:
        for _ in range(2):  # the second starts once the first decodes: its request ends after the first's would
            clients.append(subprocess.Popen([sys.executable, str(script), str(recipe), PROMPT], stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, text=True))
            assert select.select([clients[-1].stdout], [], [], 120)[0], "no ranks started"  # (only ends a hang)
            ranks.append([int(pid) for pid in clients[-1].stdout.readline().split()])
            assert len(ranks[-1]) == 2
        killed, control = clients
        killed.kill()
        deadline = time.monotonic() + 60  # (only ends a hang)
        while any(running(pid) for pid in ranks[0]):
            assert control.poll() is None, "the later client's identical request was decoded to its end first"
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert control.poll() is None and all(running(pid) for pid in ranks[1])
    finally:
        for client in clients:
            client.kill()
            client.wait(timeout=30)
        for pid in (pid for pids in ranks for pid in pids):
            with contextlib.suppress(ProcessLookupError):  # (ended already)
                os.kill(pid, signal.SIGKILL)
        gone([pid for pids in ranks for pid in pids])  # (reaped by the session's init: waited for, not asserted)


def test_torchrun_standalone_runs_the_recipe(tmp_path, code_prompts, target_reference):
    _, expected = target_reference[0]
    recipe = disaggregated_recipe(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": code_prompts[0]["prompt"]}) + "\n")
    out = tmp_path / "out.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run([*torchrun, "-m", "specgraph", "run", str(recipe), "--prompts", str(prompts),
                           "--max-new-tokens", "32", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["results"][0]["output_ids"] == expected[:32]


def test_bench_runs_the_executor_beside_serial_ar_and_transformers(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os\\nimport sys\\n"}\n{"prompt": "class Node:\\n    def __init__(self"}\n')
    out = tmp_path / "bench.json"
    from specgraph.cli import main

    assert main(["bench", str(REPO / "recipes" / "disaggregated.yaml"), "--prompts", str(prompts), "--max-new-tokens", "24",
                 "--repeats", "1", "--baselines", "hf,hf-assisted,ar,serial", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["systems"]) == {"specgraph", "serial", "ar", "hf"}
    assert "needs the drafter in the target's process" in report["skipped"]["hf-assisted"]
    assert all(r["same_tokens_as_ar"] == 1.0 for r in report["systems"].values())  # fp32 on the CPU: all exact
    mine = report["systems"]["specgraph"]
    overlap = mine["overlap"]
    assert overlap["rounds"] == len(mine["accepted_lengths"])  # one verdict per target step
    assert 0 < overlap["hidden_draft_share"] < 1 and 0 < overlap["target_busy_share"] <= 1
    assert "draft work hidden behind verification" in capsys.readouterr().out
