"""`specgraph bench RECIPE --batch 1,4,16`: many requests at once, measured per batch size.

For each batch size B every system decodes all the prompts with at most B in flight (the
engine's continuous batching: a finished request's place goes to the next at once): the recipe's
engine, `ar` (the same engine without drafts) and `hf` (transformers `generate` over left-padded
batches of B prompts, greedy, a static cache). Each (system, B) first decodes prompts untimed
(compilation and CUDA-graph capture happen there: for the engine 2B of them, B at a time, so that
the shapes a full batch's newcomers and its end run, joining one by one, are captured too; run 111
met them in the timed run, which paid each one's first run and capture), then all of them, timed: output tokens per
second over the run, tokens per second of a request (its tokens over its own time, averaged),
mean accepted length, draft and verify ms per step, draft nodes verified per step and peak memory.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from specgraph.bench.harness import device_name, progress_bars, recipe_settings
from specgraph.bench.systems import hf_mirror
from specgraph.engine.engine import Engine
from specgraph.errors import SpecgraphError
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.recipe import Recipe

BASELINES = ("ar", "hf", "always")  # and epsilon=E: the recipe's budget at another epsilon (recalibrated)


@dataclass
class BatchSpec:
    recipe: Recipe
    prompts: list[dict]  # {"id", "prompt"}
    max_new_tokens: int
    batches: list[int]
    baselines: tuple[str, ...] = BASELINES
    widen: str | None = None


def run_batched_bench(spec: BatchSpec) -> dict:
    unknown = [b for b in spec.baselines if b not in BASELINES and epsilon_of(b) is None]
    if unknown:
        raise SpecgraphError(f"--baselines: {unknown[0]} is not measured with --batch; valid there: "
                             f"{', '.join(BASELINES)}, epsilon=E (E at least 0; a recipe with a budget)")
    if any(epsilon_of(b) is not None for b in spec.baselines) and not any(
            s.verify.budget for s in spec.recipe.stages):
        raise SpecgraphError(f"--baselines epsilon=E: recipe {spec.recipe.name} verifies no budget "
                             "(stages.N.verify.budget); give one, e.g. --set stages.1.verify.budget.epsilon=0.1")
    if spec.recipe.execution != "serial":
        raise SpecgraphError(f"--batch: execution {spec.recipe.execution!r} decodes one request at a time; "
                             "measure a serial recipe")
    most = max(spec.batches)
    recipe = spec.recipe.model_copy(update={"serving": spec.recipe.serving.model_copy(update={"max_batch": most})})
    with Program(plan(recipe), widen=spec.widen) as program:
        if program.cluster is not None:
            raise SpecgraphError(f"--batch: recipe {spec.recipe.name} runs over several processes (split stages), "
                                 "which decode one request at a time; measure a recipe whose stages have one device each")
        encoded = [program.encode(p["prompt"]) for p in spec.prompts]
        systems = {"specgraph": program.executor}
        if "ar" in spec.baselines:
            systems["ar"] = program.autoregressive()
        if "always" in spec.baselines:
            systems["always"] = program.engine(speculation="always")
        for name in spec.baselines:
            if epsilon_of(name) is not None:
                systems[name] = program.engine(epsilon=epsilon_of(name))
        target = program.graph.node(program.graph.target)
        if "hf" in spec.baselines:
            systems["hf"] = HFBatches(hf_mirror(program.stages[program.graph.target].model, target["config"]),
                                      target["eos_ids"])
        device = program.executor.device
        results: dict[str, dict[int, dict]] = {name: {} for name in systems}
        with progress_bars() as progress:
            for name, system in systems.items():
                for batch in spec.batches:
                    task = progress.add_task(f"{name} x{batch}", total=len(encoded))
                    measure = measure_engine if isinstance(system, Engine) else system.measure
                    results[name][batch] = measure(system, encoded, spec.max_new_tokens, batch,
                                                   lambda: progress.advance(task))
                    progress.console.print(_line(name, batch, results[name][batch]), highlight=False, markup=False)
    outputs = {(name, batch): result.pop("outputs") for name, by_batch in results.items()
               for batch, result in by_batch.items()}
    for (name, batch), mine in outputs.items():  # (None where ar did not run, or the recipe samples)
        reference = outputs.get(("ar", batch))
        results[name][batch]["same_tokens_as_ar"] = (
            None if reference is None or spec.recipe.sampling.temperature > 0
            else sum(map(list.__eq__, mine, reference)) / len(mine))
    return {"recipe": spec.recipe.name, "settings": recipe_settings(spec.recipe), "widen": spec.widen,
            "device": device_name(device), "date": time.strftime("%Y-%m-%d"), "prompts": len(encoded),
            "max_new_tokens": spec.max_new_tokens, "batches": spec.batches, "systems": results,
            "speedup": {batch: results["specgraph"][batch]["tokens_per_second"] / results["ar"][batch]["tokens_per_second"]
                        for batch in spec.batches} if "ar" in results else {}}


def epsilon_of(baseline: str) -> float | None:
    """E of a baseline named epsilon=E (E at least 0), else None."""
    name, _, value = baseline.partition("=")
    try:
        return float(value) if name == "epsilon" and float(value) >= 0 else None
    except ValueError:
        return None


def measure_engine(engine: Engine, encoded: list[list[int]], max_new_tokens: int, batch: int, advance) -> dict:
    """The engine decoding every prompt, at most `batch` at once (after an untimed pass over 2 `batch` of them)."""
    engine.limit = batch
    for ids in encoded[: 2 * batch]:  # untimed: compilation and capture at this batch size, newcomers, its end
        engine.add_request(ids, max_new_tokens)
    while engine.busy:
        engine.step()
    device = engine.device
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine.totals = type(engine.totals)()
    began = time.perf_counter()
    requests = [engine.add_request(ids, max_new_tokens) for ids in encoded]
    while engine.busy:
        for request in engine.step():
            if request.finished:
                advance()
    _sync(device)
    seconds = time.perf_counter() - began
    gens = [r.generation for r in requests]
    totals = engine.totals
    accepted = [n for g in gens for n in g.accepted_lengths]
    return {"tokens_per_second": sum(len(g.output_ids) for g in gens) / seconds, "seconds": seconds,
            "decode_tokens_per_second": totals.decode_tokens / totals.decode_seconds if totals.decode_seconds else None,
            "steps_per_mode": dict(totals.modes),  # (a policy's choices)
            "rates_per_mode": totals.rates(),  # (what the policy expected of each mode and what it gave)
            "budget_nodes": None if engine.budget is None else {c: engine.budget(c) for c in range(1, batch + 1)},
            "request_tokens_per_second": statistics.mean(len(g.output_ids) / g.seconds for g in gens),
            "ttft_seconds": statistics.median(g.first_token_seconds - g.queued_seconds for g in gens),  # (from its admission)
            "mean_accepted_length": sum(accepted) / len(accepted),
            "draft_step_ms": 1e3 * totals.draft_seconds / totals.steps, "verify_step_ms": 1e3 * totals.verify_seconds / totals.steps,
            "nodes_per_step": totals.nodes / totals.steps, "requests_per_step": totals.requests / totals.steps,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "outputs": [g.output_ids for g in gens]}


class HFBatches:
    """transformers `generate`, greedy, over left-padded batches of the prompts (a static cache)."""

    def __init__(self, hf: torch.nn.Module, eos_ids: tuple[int, ...]):
        self.hf, self.eos_ids = hf, tuple(eos_ids)
        self.pad = eos_ids[0] if eos_ids else 0

    @torch.inference_mode()
    def _generate(self, batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(map(len, batch))
        device = self.hf.device
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        out = self.hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                               do_sample=False, eos_token_id=list(self.eos_ids), pad_token_id=self.pad,
                               cache_implementation="static")
        rows = []
        for row in out[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            rows.append(row if end is None else row[: end + 1])
        return rows

    def measure(self, _, encoded: list[list[int]], max_new_tokens: int, batch: int, advance) -> dict:
        device = self.hf.device
        self._generate(encoded[:batch], max_new_tokens)  # untimed: compilation at this batch size
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        began, outputs = time.perf_counter(), []
        for start in range(0, len(encoded), batch):
            outputs += self._generate(encoded[start : start + batch], max_new_tokens)
            _sync(device)
            for _ in range(len(encoded[start : start + batch])):
                advance()
        seconds = time.perf_counter() - began
        return {"tokens_per_second": sum(map(len, outputs)) / seconds, "seconds": seconds,
                "decode_tokens_per_second": None, "steps_per_mode": None, "budget_nodes": None,
                "request_tokens_per_second": None, "ttft_seconds": None, "mean_accepted_length": None,
                "draft_step_ms": None, "verify_step_ms": None, "nodes_per_step": None, "requests_per_step": None,
                "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                "outputs": outputs}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, spec)


def _line(name: str, batch: int, r: dict) -> str:
    steps = "" if r["mean_accepted_length"] is None else (
        f" ({r['decode_tokens_per_second'] or 0:.1f} decoding), {r['mean_accepted_length']:.2f} accepted, "
        f"{r['nodes_per_step']:.1f} nodes verified per step, steps per mode {r['steps_per_mode']}")
    return f"{name} at batch {batch}: {r['tokens_per_second']:.1f} tok/s{steps}"


REPORT = {"recipe": str, "device": str, "prompts": int, "max_new_tokens": int, "batches": list, "systems": dict}
RESULT = ("tokens_per_second", "request_tokens_per_second", "ttft_seconds", "mean_accepted_length", "draft_step_ms",
          "verify_step_ms", "nodes_per_step", "peak_memory_bytes", "same_tokens_as_ar")  # what a row prints


def check_batched(name: str, report: dict) -> None:
    """A one-line error unless `report` is a `bench --batch` report that print_batched and plot_batched read."""
    damaged = "the batch report is damaged; rerun its bench"
    for key, kind in REPORT.items():
        if not isinstance(report.get(key), kind):
            raise SpecgraphError(f"report: {name} has no {key} ({kind.__name__}); {damaged}")
    if "widen" not in report:
        raise SpecgraphError(f"report: {name} has no widen; {damaged}")
    if not isinstance(report["systems"].get("specgraph"), dict):
        raise SpecgraphError(f"report: {name} has no 'specgraph' system; {damaged}")
    batches = set(report["systems"]["specgraph"])
    for system, by_batch in report["systems"].items():
        if not isinstance(by_batch, dict) or set(by_batch) != batches or not all(str(b).isdigit() for b in batches):
            raise SpecgraphError(f"report: {name}: system {system!r} was not measured at specgraph's batch sizes; {damaged}")
        for batch, result in by_batch.items():
            missing = [key for key in RESULT if not isinstance(result, dict) or key not in result]
            if missing:
                raise SpecgraphError(f"report: {name}: system {system!r} at batch {batch} has no {', '.join(missing)}; "
                                     f"{damaged}")
            if not isinstance(result["tokens_per_second"], (int, float)) or not result["tokens_per_second"] > 0:
                raise SpecgraphError(f"report: {name}: system {system!r} at batch {batch} has tokens_per_second "
                                     f"{result['tokens_per_second']!r}, not a positive number; {damaged}")


def print_batched(report: dict, console: Console | None = None) -> None:
    console = console or Console(width=None if console else 200)
    table = Table(title=f"{report['recipe']} on {report['device']}" + (f", widened to {report['widen']}"
                  if report["widen"] else "") + f": {report['prompts']} prompts x {report['max_new_tokens']} tokens")
    for column in ("system", "batch", "tok/s", "decode tok/s", "per request", "specgraph ÷", "TTFT ms", "accepted",
                   "draft ms", "verify ms", "nodes/step", "steps per mode", "expected/realised tok/s", "peak GiB",
                   "= ar"):
        table.add_column(column, no_wrap=True)
    for name, by_batch in report["systems"].items():
        for batch, r in by_batch.items():
            ours = report["systems"]["specgraph"][batch]["tokens_per_second"]
            modes = ", ".join(f"{mode} {steps}" for mode, steps in (r.get("steps_per_mode") or {}).items()) or "—"
            rates = ", ".join(f"{mode} {rate['expected']:.0f}/{rate['realised']:.0f}"
                              for mode, rate in (r.get("rates_per_mode") or {}).items()) or "—"
            table.add_row(name, str(batch), f"{r['tokens_per_second']:.1f}", _fmt(r.get("decode_tokens_per_second"), ".1f"),
                          _fmt(r["request_tokens_per_second"], ".1f"),
                          "—" if name == "specgraph" else f"{ours / r['tokens_per_second']:.2f}x",
                          _fmt(r["ttft_seconds"], ".1f", 1e3), _fmt(r["mean_accepted_length"], ".2f"),
                          _fmt(r["draft_step_ms"], ".2f"), _fmt(r["verify_step_ms"], ".2f"), _fmt(r["nodes_per_step"], ".1f"),
                          modes, rates, _fmt(r["peak_memory_bytes"], ".1f", 2 ** -30), _fmt(r["same_tokens_as_ar"], ".0%"))
    console.print(table)
    console.print("tok/s: output tokens per second of the whole run; decode tok/s: those of the steps that fed no "
                  "prompt beside them, over their time; per request: a request's tokens over its own time, averaged; "
                  "specgraph ÷: its tok/s over the row's at the same batch size; TTFT: a request's admission to its "
                  "first tokens (median); nodes/step: draft nodes verified per step over the batch; steps per mode: "
                  "the policy's choices; expected/realised tok/s: by mode, what the policy expected of its steps and what they "
                  "gave, over their time from the step before's collection; = ar: share of prompts whose tokens equal ar's")


def plot_batched(report: dict, path) -> None:
    """Tokens/s against batch size, a line per system."""
    from specgraph.bench.report import plot_format
    from specgraph.files import write_output

    fmt = plot_format(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4))
    for name, by_batch in report["systems"].items():
        batches = sorted(by_batch, key=int)  # (ints as bench keeps them, strings as its JSON has them)
        axis.plot([int(b) for b in batches], [by_batch[b]["tokens_per_second"] for b in batches], marker="o", label=name)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("requests at once")
    axis.set_ylabel("output tokens/s")
    axis.set_title(f"{report['recipe']} on {report['device']}", fontsize=9)
    axis.legend()
    fig.tight_layout()
    write_output(path, lambda f: fig.savefig(f, dpi=110, format=fmt))
    plt.close(fig)
