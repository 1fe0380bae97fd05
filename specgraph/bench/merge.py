"""`specgraph report`: bench reports of the same systems on different prompts, merged into one.

A benchmark too long for one sitting (a time-limited GPU call) runs as several `specgraph bench`
processes over parts of a prompt file, each measuring every system; merging their JSON reports
gives what one run over all the prompts would have printed: each repeat's decode tokens/s is the
parts' decode tokens over their summed decode seconds, TTFT the median over every prompt, the
step figures over every step, `= ar` over every prompt, and an asynchronous executor's statistics
(disaggregated `overlap`, `pipeline` stages) computed by bench's own function from the parts'
summed statistics. The parts must agree on what was measured (the recipe's every field with the
command's --set, shape, device, new tokens, repeats, systems and their descriptions) and share
no prompt (told by the digests of their texts: a merge would count it twice); a single part is
checked and printed as it is. The bandwidth bound's bytes per token is the prompt-weighted mean
of the parts' (it is linear in the mean context), its copy bandwidth the mean of the parts'
measurements.
"""

from __future__ import annotations

import statistics

from specgraph.bench.harness import bandwidth_bound, executor_stats, speedups
from specgraph.errors import SpecgraphError
from specgraph.runtime.executor import total_stats

AGREE = ("recipe", "settings", "widen", "device", "max_new_tokens", "repeats")  # what every part measured alike
# a report's keys that a merge reads, with their types (prompt_ids, prompt_digests: each prompt's id and
# its text's SHA-256, in order, since issue 32)
PART = {"date": str, "prompts": int, "repeats": int, "max_new_tokens": int, "systems": dict, "skipped": dict,
        "settings": dict, "prompt_ids": list, "prompt_digests": list}
# each system's (per repeat and per prompt: since 2026-12-02; executor_stats, its executor's statistics
# summed over the prompts: since issue 32)
SYSTEM = {"description": str, "decode_tokens": list, "decode_seconds": list, "first_token_seconds": list,
          "new_tokens": int, "accepted_lengths": list, "executor_stats": dict}


def check_part(name: str, report) -> None:
    """A one-line error unless `report` is a bench report that a merge can read."""
    if not isinstance(report, dict) or not isinstance(report.get("systems"), dict):
        raise SpecgraphError(f"report: {name} is not a `specgraph bench --json` report (it has no systems)")
    for key, kind in PART.items():
        if not isinstance(report.get(key), kind):
            raise SpecgraphError(f"report: {name} has no {key} ({kind.__name__}): written by an older specgraph or "
                                 "not by bench; rerun its bench to merge it")
    for key in ("prompt_ids", "prompt_digests"):
        if len(report[key]) != report["prompts"]:
            raise SpecgraphError(f"report: {name} has {len(report[key])} {key}, not {report['prompts']}; the report "
                                 "is damaged")
    if "specgraph" not in report["systems"]:
        raise SpecgraphError(f"report: {name} has no 'specgraph' system")
    for system, result in report["systems"].items():
        missing = [key for key, kind in SYSTEM.items() if not isinstance(result, dict) or not isinstance(result.get(key), kind)]
        if missing:
            raise SpecgraphError(f"report: {name}: system {system!r} has no {', '.join(missing)} (written by an "
                                 "older specgraph or not by bench); rerun its bench to merge it")
        counts = {"decode_tokens": report["repeats"], "decode_seconds": report["repeats"],
                  "first_token_seconds": report["prompts"]}
        for key, count in counts.items():
            if len(result[key]) != count:
                raise SpecgraphError(f"report: {name}: system {system!r} has {len(result[key])} {key}, not "
                                     f"{count}; the report is damaged")


def merge_reports(parts: list[tuple[str, dict]]) -> dict:
    """(name, report) of each part -> one report over all their prompts."""
    for name, report in parts:
        check_part(name, report)
    if len(parts) == 1:
        return parts[0][1]
    (first_name, first), rest = parts[0], parts[1:]
    for name, report in rest:
        for key in AGREE:
            if report.get(key) != first.get(key):
                shown = "its recipe's fields (--set, trees, paths)" if key == "settings" else (
                    f"{key}: {report.get(key)!r} against {first.get(key)!r}")
                raise SpecgraphError(f"report: {name} differs from {first_name} in {shown}; merge only parts of one "
                                     "benchmark")
        if list(report["systems"]) != list(first["systems"]):
            raise SpecgraphError(f"report: {name} measured {', '.join(report['systems'])}, {first_name} "
                                 f"{', '.join(first['systems'])}; merge only parts with the same systems")
        for system, result in report["systems"].items():
            if result["description"] != first["systems"][system]["description"]:
                raise SpecgraphError(f"report: {name} ran {system!r} as {result['description']!r}, {first_name} as "
                                     f"{first['systems'][system]['description']!r}; merge only parts of one benchmark")
    for i, part in enumerate(parts):
        for earlier in parts[:i]:
            _check_disjoint(part, earlier)
    reports = [report for _, report in parts]
    systems = {system: _merge_system([r["systems"][system] for r in reports], [r["prompts"] for r in reports])
               for system in first["systems"]}
    dates = sorted({r["date"] for r in reports})
    merged = {**{key: first[key] for key in AGREE}, "date": dates[0] if len(dates) == 1 else f"{dates[0]}..{dates[-1]}",
              "prompts": sum(r["prompts"] for r in reports),
              **{key: [item for r in reports for item in r[key]] for key in ("prompt_ids", "prompt_digests")},
              "warmup_prompts": sum(r.get("warmup_prompts", r["prompts"]) for r in reports),
              "systems": systems, "skipped": {k: v for r in reports for k, v in r["skipped"].items()},
              "speedup": speedups(systems),
              "merged_from": [source for name, r in parts for source in r.get("merged_from", [name])]}
    bounds = [r.get("bandwidth_bound") for r in reports]
    if "ar" in systems and all(isinstance(b, dict) for b in bounds):
        weights = [r["prompts"] for r in reports]
        merged["bandwidth_bound"] = bandwidth_bound(
            statistics.mean(b["copy_bandwidth_bytes_per_s"] for b in bounds),
            sum(w * b["bytes_per_token"] for w, b in zip(weights, bounds)) / sum(weights),
            bounds[0]["weight_bytes"], systems["ar"])
    return merged


def _check_disjoint(part: tuple[str, dict], earlier: tuple[str, dict]) -> None:
    """A one-line error where two parts (name, report) measured a prompt of the same text."""
    (name, report), (earlier_name, other) = part, earlier
    ours, theirs = set(report["prompt_digests"]), set(other["prompt_digests"])
    if ours == theirs:
        count = report["prompts"]
        raise SpecgraphError(f"report: {name} measured the same {count} prompt{'s' * (count != 1)} as {earlier_name}: "
                             "one part given twice; give each part once")
    ids = [i for i, digest in zip(report["prompt_ids"], report["prompt_digests"]) if digest in theirs]
    if ids:
        shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        raise SpecgraphError(f"report: {name} measured {len(ids)} prompt{'s' * (len(ids) != 1)} that {earlier_name} "
                             f"measured too (id{'s' * (len(ids) != 1)} {shown}); merge only parts over different "
                             "prompts (a merge would count them twice)")


def _merge_system(results: list[dict], prompts: list[int]) -> dict:
    """One system's figures over every part (`prompts`: each part's prompt count)."""
    decode_tokens = [sum(repeat) for repeat in zip(*(r["decode_tokens"] for r in results))]
    decode_seconds = [sum(repeat) for repeat in zip(*(r["decode_seconds"] for r in results))]
    tps = [tokens / seconds for tokens, seconds in zip(decode_tokens, decode_seconds)]
    first_token_seconds = [s for r in results for s in r["first_token_seconds"]]
    steps = [n for r in results for n in r["accepted_lengths"]]

    def per_step(key: str) -> float | None:  # a mean over each part's steps, over all of them
        weighted = [(r.get(key), len(r["accepted_lengths"])) for r in results if r["accepted_lengths"]]
        if not weighted or any(ms is None for ms, _ in weighted):
            return None
        return sum(ms * n for ms, n in weighted) / len(steps)

    peaks = [r.get("peak_memory_bytes") for r in results]
    same = [r.get("same_tokens_as_ar") for r in results]
    return {
        "description": results[0]["description"],
        "tokens_per_second": {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "runs": tps},
        "decode_tokens": decode_tokens, "decode_seconds": decode_seconds,
        "new_tokens": sum(r["new_tokens"] for r in results),
        "ttft_seconds": statistics.median(first_token_seconds), "first_token_seconds": first_token_seconds,
        "mean_accepted_length": sum(steps) / len(steps) if steps else None,
        "accepted_lengths": steps,
        "draft_step_ms": per_step("draft_step_ms"), "verify_step_ms": per_step("verify_step_ms"),
        "peak_memory_bytes": None if None in peaks else max(peaks),
        "same_tokens_as_ar": None if None in same else sum(s * n for s, n in zip(same, prompts)) / sum(prompts),
        **executor_stats(total_stats(r["executor_stats"] for r in results)),  # (as bench sums its requests')
    }
