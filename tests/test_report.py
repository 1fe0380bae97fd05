"""specgraph report: bench reports of parts of a prompt file merged into one."""

import hashlib
import itertools
import json
import os
import stat

import pytest
from conftest import REPO
from helpers import character_device

from specgraph.bench.systems import SpecgraphSystem
from specgraph.cli import main
from specgraph.runtime.pipeline import StageCounts

PROMPTS = ["import os\nimport sys\n", "class Node:\n    def __init__(self", "def fib(n):", "for i in range(10):"]


def bench(tmp_path, name: str, prompts: list[str]) -> dict:
    file, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
    file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    assert main(["bench", str(REPO / "recipes" / "tree.yaml"), "--prompts", str(file), "--max-new-tokens", "12",
                 "--repeats", "2", "--baselines", "ar", "--json", str(out), "--set", "serving.speculation=always",
                 "--threads", "1"]) == 0
    # (threads follow the load by default: parts would name different devices; the adaptive policy's choices follow
    # measured step times: parts would take different steps)
    return out


def request_stats(system: str, ids: list[int]) -> dict[str, float]:
    """One request's executor statistics, made up from its prompt's length: a two-stage pipeline's
    (StageCounts, keyed as the pipeline executor keys them) for specgraph, a disaggregated
    executor's for ar. Every value is a multiple of 1/32 below 2^20, so sums in any order are exact."""
    n = len(ids)
    if system == "specgraph":
        return {**StageCounts(0, steps=2 * n, step_seconds=n / 8, idle_seconds=1 / 4, proposed=3 * n).stats("draft"),
                **StageCounts(1, steps=n, step_seconds=n / 4, idle_seconds=n / 16, proposed=n, verified=3 * n,
                              accepted=2 * n, rejections=n // 3 + 1, rolled_back=n % 2, dropped=n % 3,
                              window=4).stats("target")}
    return {"target_verify_seconds": n / 8, "target_wait_seconds": 1 / 16, "draft_hidden_seconds": n / 32,
            "draft_critical_seconds": 1 / 8, "draft_idle_seconds": 1 / 4, "rounds": n, "survived": n // 2,
            "bonus_not_grown": 1}


def test_merged_halves_report_what_one_run_over_all_prompts_decodes(tmp_path, capsys, monkeypatch):
    """Halves of a prompt file and the whole, each a bench run: the merged halves have the whole's
    steps and tokens, and its executor statistics, made up per request and summed by bench itself."""
    decode = SpecgraphSystem.run

    def with_stats(self, ids, max_new_tokens):  # the executors' statistics come through bench's own code path
        run = decode(self, ids, max_new_tokens)
        run.stats = request_stats(self.name, ids)
        return run

    monkeypatch.setattr(SpecgraphSystem, "run", with_stats)
    halves = [bench(tmp_path, "first", PROMPTS[:2]), bench(tmp_path, "last", PROMPTS[2:])]
    whole = json.loads(bench(tmp_path, "whole", PROMPTS).read_text())
    assert whole["prompt_digests"] == [hashlib.sha256(p.encode()).hexdigest() for p in PROMPTS]
    out = tmp_path / "merged.json"
    capsys.readouterr()
    assert main(["report", *map(str, halves), "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "4 prompts x 12 tokens, 2 repeats, merged from 2 reports" in printed
    assert "stage target:" in printed and "draft work hidden behind verification" in printed
    merged = json.loads(out.read_text())
    assert merged["prompts"] == 4 and list(merged["systems"]) == ["specgraph", "ar"]
    assert merged["prompt_digests"] == whole["prompt_digests"]
    assert "pipeline" in whole["systems"]["specgraph"] and "overlap" in whole["systems"]["ar"]
    for name, result in merged["systems"].items():  # greedy decoding: the same steps as the whole run's
        alone = whole["systems"][name]
        for key in ("accepted_lengths", "mean_accepted_length", "new_tokens", "decode_tokens", "same_tokens_as_ar",
                    "executor_stats", "pipeline", "overlap"):
            assert result.get(key) == alone.get(key), (name, key)
        assert len(result["first_token_seconds"]) == 4 and len(result["tokens_per_second"]["runs"]) == 2
    assert merged["speedup"]["ar"] == pytest.approx(merged["systems"]["specgraph"]["tokens_per_second"]["median"]
                                                    / merged["systems"]["ar"]["tokens_per_second"]["median"])


PROMPT_IDS = itertools.count()


def part(device: str = "cpu", tokens=(100, 100), seconds=(1.0, 1.0), ttft=(0.5,), steps=(2, 3), draft=1.0,
         same=1.0, bytes_per_token=1e9, bandwidth=2e9, ar_seconds=(2.0, 2.0), ids=None) -> dict:
    """A report as bench writes it, with the figures a merge reads chosen by hand (ar decodes the
    same tokens in `ar_seconds`); its prompts are `ids` (one per `ttft`), else ones no other part has."""
    ids = [str(next(PROMPT_IDS)) for _ in ttft] if ids is None else list(ids)

    def system(seconds, lengths, ms, description):
        return {"description": description, "tokens_per_second": {"median": 0, "min": 0, "max": 0, "runs": []},
                "decode_tokens": list(tokens), "decode_seconds": list(seconds), "new_tokens": tokens[-1] + len(ttft),
                "ttft_seconds": 0, "first_token_seconds": list(ttft), "mean_accepted_length": 0,
                "accepted_lengths": list(lengths), "draft_step_ms": ms, "verify_step_ms": 2 * ms,
                "peak_memory_bytes": 10 * len(ttft), "same_tokens_as_ar": same, "executor_stats": {}}
    return {"recipe": "r", "settings": {"name": "r"}, "widen": None, "device": device, "date": "2026-12-02",
            "prompts": len(ttft), "prompt_ids": ids, "prompt_digests": [f"digest of {i}" for i in ids],
            "max_new_tokens": 8, "repeats": len(tokens), "warmup_prompts": len(ttft),
            "skipped": {}, "speedup": {},
            "systems": {"specgraph": system(seconds, steps, draft, "tree"),
                        "ar": system(ar_seconds, [1] * (tokens[-1] + len(ttft)), 0.0, "target alone")},
            "bandwidth_bound": {"copy_bandwidth_bytes_per_s": bandwidth, "bytes_per_token": bytes_per_token,
                                "weight_bytes": 7, "tokens_per_second": 0, "ar_fraction": 0}}


def write(tmp_path, **reports) -> list:
    files = []
    for name, report in reports.items():
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(report))
    return files


def test_a_merge_adds_tokens_and_seconds_not_rates(tmp_path, capsys):
    a = part(tokens=(100, 100), seconds=(1.0, 2.0), ttft=(0.1,), steps=(2, 2), draft=1.0, same=1.0,
             bytes_per_token=1e9, bandwidth=2e9, ar_seconds=(4.0, 4.0))
    b = part(tokens=(300, 300), seconds=(6.0, 2.0), ttft=(0.2, 0.3, 0.9), steps=(4, 4, 4, 4, 4, 4), draft=4.0,
             same=0.0, bytes_per_token=2e9, bandwidth=4e9, ar_seconds=(4.0, 4.0))
    out = tmp_path / "m.json"
    assert main(["report", *map(str, write(tmp_path, a=a, b=b)), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    ours, ar = merged["systems"]["specgraph"], merged["systems"]["ar"]
    assert ours["tokens_per_second"]["runs"] == pytest.approx([400 / 7, 400 / 4])  # not 75 (their mean), not 66.7
    assert (ours["tokens_per_second"]["min"], ours["tokens_per_second"]["max"]) == pytest.approx((400 / 7, 100))
    assert ours["tokens_per_second"]["median"] == pytest.approx((400 / 7 + 100) / 2)
    assert ar["tokens_per_second"]["median"] == pytest.approx(50)  # 400 tokens in 8 s, both repeats
    assert merged["speedup"]["ar"] == pytest.approx((400 / 7 + 100) / 2 / 50)
    assert ours["ttft_seconds"] == pytest.approx(0.25)  # the median of 0.1, 0.2, 0.3, 0.9
    assert ours["mean_accepted_length"] == pytest.approx(28 / 8)
    assert ours["draft_step_ms"] == pytest.approx((2 * 1.0 + 6 * 4.0) / 8)  # per step, over every step
    assert ours["verify_step_ms"] == pytest.approx((2 * 2.0 + 6 * 8.0) / 8)
    assert ours["same_tokens_as_ar"] == pytest.approx(1 / 4)  # one prompt of four
    assert (ours["new_tokens"], ours["peak_memory_bytes"], merged["prompts"]) == (101 + 303, 30, 4)
    bound = merged["bandwidth_bound"]
    assert bound["bytes_per_token"] == pytest.approx((1 * 1e9 + 3 * 2e9) / 4)  # prompt-weighted
    assert bound["tokens_per_second"] == pytest.approx(3e9 / 1.75e9)
    assert bound["ar_fraction"] == pytest.approx(50 / (3e9 / 1.75e9))
    assert merged["merged_from"] == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]


@pytest.mark.parametrize("change, expected", [
    (lambda r: r.update(device="cuda"), "report: {b} differs from {a} in device: 'cuda' against 'cpu'"),
    (lambda r: r.update(repeats=3), "report: {b}: system 'specgraph' has 2 decode_tokens, not 3"),
    (lambda r: r["settings"].update(max_new_tokens=9), "report: {b} differs from {a} in its recipe's fields"),
    (lambda r: r["systems"]["ar"].update(description="x"), "report: {b} ran 'ar' as 'x', {a} as 'target alone'"),
    (lambda r: r["systems"].pop("ar"), "report: {b} measured specgraph, {a} specgraph, ar"),
    (lambda r: r["systems"]["ar"].pop("decode_seconds"), "report: {b}: system 'ar' has no decode_seconds"),
    (lambda r: r["systems"]["ar"]["decode_tokens"].pop(), "report: {b}: system 'ar' has 1 decode_tokens, not 2"),
    (lambda r: r["systems"]["ar"].pop("executor_stats"), "report: {b}: system 'ar' has no executor_stats"),
    (lambda r: r.pop("prompts"), "report: {b} has no prompts (int)"),
    (lambda r: r.pop("prompt_digests"), "report: {b} has no prompt_digests (list)"),
    (lambda r: r["prompt_ids"].append("x"), "report: {b} has 2 prompt_ids, not 1"),
    (lambda r: r.pop("settings"), "report: {b} has no settings (dict)"),
    (lambda r: r["systems"].pop("specgraph"), "report: {b} has no 'specgraph' system"),
    (lambda r: r.update(systems=[]), "report: {b} is not a `specgraph bench --json` report"),
])
def test_parts_that_cannot_merge_are_one_line_errors(tmp_path, capsys, change, expected):
    other = part()
    change(other)
    a, b = write(tmp_path, a=part(), b=other)
    assert main(["report", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specgraph: error: {expected.format(a=a, b=b)}") and err.count("\n") == 1


def test_a_missing_broken_or_repeated_part_is_a_one_line_error(tmp_path, capsys):
    broken, listed, a = tmp_path / "broken.json", tmp_path / "list.json", *write(tmp_path, a=part())
    broken.write_text("{")
    listed.write_text("[]")
    for paths, expected in (([tmp_path / "none.json"], "does not exist"), ([broken], "is not JSON"),
                            ([listed], "is not a `specgraph bench --json` report"), ([a, a], "is given twice")):
        assert main(["report", *map(str, paths)]) == 2
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1


@pytest.mark.parametrize("ids, expected", [
    (("1", "2"), "report: {b} measured the same 2 prompts as {a}: one part given twice; give each part once"),
    (("2", "3"), "report: {b} measured 1 prompt that {a} measured too (id 2); merge only parts over different "
     "prompts (a merge would count them twice)"),
])
def test_parts_over_the_same_prompts_are_one_line_errors(tmp_path, capsys, ids, expected):
    """A merge would count a prompt measured by two parts twice: the same part under two names, or
    parts of overlapping prompts, are refused (told apart by the digests of their prompts' texts)."""
    a, b = write(tmp_path, a=part(ttft=(0.1, 0.2), ids=("1", "2")), b=part(ttft=(0.1, 0.2), ids=ids))
    assert main(["report", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specgraph: error: {expected.format(a=a, b=b)}") and err.count("\n") == 1


def test_a_merge_sums_executor_statistics_and_computes_their_ratios_from_the_sums(tmp_path):
    halves = []
    for n in ((1, 3), (8,)):  # prompt lengths: the first part's two requests, the second part's one
        half = part(ttft=(0.1,) * len(n))
        for name, result in half["systems"].items():
            result["executor_stats"] = {key: sum(request_stats(name, [0] * k)[key] for k in n)
                                        for key in request_stats(name, [0])}
        halves.append(half)
    out = tmp_path / "m.json"
    assert main(["report", *map(str, write(tmp_path, a=halves[0], b=halves[1])), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())["systems"]
    o = merged["ar"]["overlap"]  # lengths 1, 3, 8: hidden 12/32 of draft work 12/32 + 3/8
    assert o["hidden_draft_share"] == pytest.approx((12 / 32) / (12 / 32 + 3 / 8))
    assert (o["rounds"], o["survived"], o["survival_rate"]) == (12, 5, pytest.approx(5 / 12))
    assert o["target_busy_share"] == pytest.approx((12 / 8) / (12 / 8 + 3 / 16))
    target = merged["specgraph"]["pipeline"]["stages"]["target"]
    assert (target["steps"], target["accepted"], target["window"]) == (12, 24, 4)
    assert target["step_ms"] == pytest.approx(1e3 * (12 / 4) / 12)
    assert target["acceptance_rate"] == pytest.approx(24 / (24 + 1 + 2 + 3))  # rejections n // 3 + 1: 1, 2, 3
    assert list(merged["specgraph"]["pipeline"]["stages"]) == ["draft", "target"]


def test_a_table_printed_into_a_pipe_keeps_every_cell_on_one_line(tmp_path, capsys):
    """Where stdout is not a terminal (here pytest's capture) rich would wrap at 80 columns, folding
    cells over lines; the table keeps its natural width, and each line is whole."""
    report = part()
    report["systems"]["recipes/tree-tuned-for-one-h200.yaml"] = {
        **report["systems"]["specgraph"], "description": "trees (draft: dynamic width=4 depth=6 nodes=32) over the "
                                                         "recipe's models, serial executor, CUDA graphs per step, 1 GPU"}
    assert main(["report", str(*write(tmp_path, a=report))]) == 0
    lines = capsys.readouterr().out.splitlines()
    headers = [line for line in lines if line.startswith("┃")]
    rows = [line for line in lines if line.startswith("│")]
    assert len(headers) == 1 and [cell.strip() for cell in headers[0].split("┃")[1:-1]] == [
        "system", "tok/s", "min-max", "specgraph ÷", "TTFT ms", "accepted", "draft ms", "verify ms", "peak GiB", "= ar"]
    assert [row.split("│")[1].strip() for row in rows] == list(report["systems"])
    for name, result in report["systems"].items():
        assert f"  {name}: {result['description']}" in lines


def test_a_plot_is_written_in_the_format_its_suffix_names(tmp_path, capsys):
    a, = write(tmp_path, a=part())
    magic = {"png": b"\x89PNG\r\n\x1a\n", "jpg": b"\xff\xd8\xff", "JPEG": b"\xff\xd8\xff", "pdf": b"%PDF-",
             "svg": b"<?xml", "webp": b"RIFF"}
    for suffix, start in magic.items():
        out = tmp_path / f"plot.{suffix}"
        assert main(["report", str(a), "--plot", str(out)]) == 0
        assert out.read_bytes().startswith(start), suffix
    for name, why in (("plot.bmp", "unknown image suffix .bmp"), ("plot", "no suffix")):
        assert main(["report", str(tmp_path / "none.json"), "--plot", str(tmp_path / name)]) == 2  # before reading
        err = capsys.readouterr().err
        assert err.startswith(f"specgraph: error: --plot: {tmp_path / name}: {why}; valid: ") and err.count("\n") == 1
        assert ".png" in err and ".jpg" in err and ".pgf" not in err and not (tmp_path / name).exists()


def test_a_write_error_is_one_line_and_the_device_stays(tmp_path, capsys):
    a, = write(tmp_path, a=part())
    full = character_device(tmp_path, "full")
    assert main(["report", str(a), "--json", str(full)]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"specgraph: error: {full}: cannot be written (No space left on device)\n") and "Traceback" not in err
    assert stat.S_ISCHR(os.lstat(full).st_mode)
