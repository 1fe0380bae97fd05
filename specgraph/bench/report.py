"""Presenting a benchmark report: a table for the terminal and a plot for people."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from specgraph.errors import SpecgraphError
from specgraph.files import write_output


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, spec)


def _stdout() -> Console:
    """stdout's console: a terminal's width, or, where stdout is piped or redirected (where rich
    takes 80 columns and folds cells over lines), no limit: the table at its natural width and
    each line whole."""
    console = Console()
    if not console.is_terminal:
        console.width = 1 << 16
    return console


def print_table(report: dict, console: Console | None = None) -> None:
    console = console or _stdout()
    title = (f"{report['recipe']} on {report['device']}"
             + (f", widened to {report['widen']}" if report["widen"] else "")
             + "".join(f", {stage} {weights}" for stage, weights in report.get("weights", {}).items())
             + f": {report['prompts']} prompts x {report['max_new_tokens']} tokens, {report['repeats']} repeats"
             + (f" (warm-up pass on {report['warmup_prompts']})" if report.get("warmup_prompts", report["prompts"])
                < report["prompts"] else "")
             + (f", merged from {len(report['merged_from'])} reports" if "merged_from" in report else ""))
    table = Table(title=title)
    for column in ("system", "tok/s", "min-max", "specgraph ÷", "TTFT ms", "accepted", "draft ms", "verify ms",
                   "peak GiB", "= ar"):
        table.add_column(column, overflow="fold")
    for name, r in report["systems"].items():
        tps = r["tokens_per_second"]
        speedup = report["speedup"].get(name)
        table.add_row(name, f"{tps['median']:.1f}", f"{tps['min']:.1f}-{tps['max']:.1f}",
                      "—" if speedup is None else f"{speedup:.2f}x", _fmt(r["ttft_seconds"], ".1f", 1e3),
                      _fmt(r["mean_accepted_length"], ".2f"), _fmt(r["draft_step_ms"], ".2f"),
                      _fmt(r["verify_step_ms"], ".2f"), _fmt(r["peak_memory_bytes"], ".1f", 2 ** -30),
                      _fmt(r["same_tokens_as_ar"], ".0%"))
    console.print(table)
    console.print("tok/s: decode tokens per second, median and min-max over repeats; specgraph ÷: its speedup over "
                  "the row; accepted: tokens per target step; draft/verify ms: per step; = ar: share of prompts "
                  "whose tokens equal specgraph's own autoregressive output (— where the recipe samples: sampled "
                  "tokens need not equal it)")
    for name, r in report["systems"].items():
        console.print(f"  {name}: {r['description']}")
        if "overlap" in r:
            o = r["overlap"]
            console.print(f"    draft work hidden behind verification {_fmt(o['hidden_draft_share'], '.0%')}, subtree "
                          f"survived {o['survived']} of {o['rounds']} verdicts ({_fmt(o['survival_rate'], '.0%')}), "
                          f"busy: target {_fmt(o['target_busy_share'], '.0%')}, drafter {_fmt(o['draft_busy_share'], '.0%')}")
        if r.get("pipeline"):
            _print_pipeline(r["pipeline"], r["tokens_per_second"]["median"], console)
    for name, why in report["skipped"].items():
        console.print(f"  {name}: not run: {why}")
    if "bandwidth_bound" in report:
        b = report["bandwidth_bound"]
        console.print(f"memory-bandwidth bound of autoregressive decoding: {b['tokens_per_second']:.1f} tokens/s "
                      f"({b['bytes_per_token'] / 1e9:.3f} GB per token at a measured copy bandwidth of "
                      f"{b['copy_bandwidth_bytes_per_s'] / 1e12:.3f} TB/s); ar reaches {b['ar_fraction']:.1%} of it")


def _print_pipeline(pipeline: dict, measured: float, console: Console) -> None:
    for name, s in pipeline["stages"].items():
        console.print(f"    stage {name}: {s['steps']} steps of {_fmt(s['step_ms'], '.2f')} ms, idle "
                      f"{_fmt(s['idle_share'], '.0%')}; proposed {s['proposed']}, in windows {s['verified']} "
                      f"(window {s['window']}), accepted {s['accepted']} (alpha {_fmt(s['acceptance_rate'], '.2f')}), "
                      f"rolled back {s['rolled_back']}, dropped {s['dropped']}")
    a = pipeline["analytic"]
    if a is not None:
        console.print(f"    PipeSpec's steady-state model: alpha {a['alpha']:.2f}, window {a['window']}: rho {a['rho']:.2f}, "
                      f"{a['tokens_per_step']:.2f} tokens per last-stage step -> {a['tokens_per_second']:.1f} tok/s "
                      f"(measured {measured:.1f})")


def plot_format(path: Path) -> str:
    """The image format `--plot PATH` writes: the one its suffix names, of those matplotlib writes
    (pgf left out: it needs a LaTeX installation); refused in one line otherwise."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise SpecgraphError("--plot needs matplotlib: python3 -m pip install matplotlib") from None
    formats = sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})
    suffix = Path(path).suffix.lower().removeprefix(".")
    if suffix not in formats:
        raise SpecgraphError(f"--plot: {path}: {f'unknown image suffix .{suffix}' if suffix else 'no suffix'}; "
                             f"valid: {', '.join('.' + f for f in formats)}")
    return suffix


def plot(report: dict, path: Path) -> None:
    """Tokens/s per system and specgraph's accepted lengths, written to `path` in the format its suffix names."""
    fmt = plot_format(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = report["systems"]
    names = list(systems)
    medians = [systems[n]["tokens_per_second"]["median"] for n in names]
    errors = [[m - systems[n]["tokens_per_second"]["min"] for n, m in zip(names, medians)],
              [systems[n]["tokens_per_second"]["max"] - m for n, m in zip(names, medians)]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(names, medians, yerr=errors, capsize=4, color=["tab:blue"] + ["tab:gray"] * (len(names) - 1))
    left.set_ylabel("decode tokens/s (median, min-max)")
    left.set_title(f"{report['recipe']} on {report['device']}" + (f" ({report['widen']})" if report["widen"] else ""),
                   fontsize=9)
    accepted = systems["specgraph"]["accepted_lengths"]
    if accepted:
        right.hist(accepted, bins=range(1, max(accepted) + 2), align="left", rwidth=0.8)
    right.set_xlabel("tokens committed per target step")
    right.set_ylabel("steps")
    right.set_title("specgraph accepted lengths", fontsize=9)
    fig.tight_layout()
    write_output(path, lambda f: fig.savefig(f, dpi=110, format=fmt))
    plt.close(fig)
