"""`specgraph tune`: a draft-tree size calibrated to this machine (Bole's verification budget,
../shared/papers/003_*).

Verifying more nodes costs a target little while its forward is bound by memory traffic (a GPU)
and a lot where it is bound by arithmetic (a CPU), so the best tree depends on the machine.
Tune loads the recipe's stages once, lowered as its plan says, and measures, for candidate
dynamic trees (width, depth, nodes):
  verification - the target's forward of T tokens (the root and a chain of T - 1 drafts after it)
                 at a realistic cache position (the prompts' mean length plus half the new tokens),
                 for T in powers of two and every candidate's nodes + 1, as a step runs it: one
                 CUDA graph where the stage's shapes are static (a GPU), compiled where the plan
                 compiles; the best of 5 timings after warm-up calls (`best_seconds`);
  drafting and acceptance - the serial executor decoding the prompts with each candidate's plan
                 (its stages built over the same lowered models, `stage_over`): tokens per target
                 step (a request's last step counts what its budget left it) and the draft phase's
                 time per step by the executor's own clock, after an untimed pass (`measure_system`,
                 as `specgraph bench` measures a system);
and estimates each candidate's tokens/s = accepted per step / (draft + verification(nodes + 1)).
Rules: `throughput` picks the highest estimate; `bole` the largest tree whose verification costs
at most (1 + epsilon) one-token forwards (among trees of that size, the highest estimate). A
candidate's epsilon is its measured verification(nodes + 1) / verification(1) - 1.
"""

from __future__ import annotations

import functools
import gc
import itertools
import statistics
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from specgraph.bench.harness import (
    BenchSpec,
    device_name,
    measure_system,
    progress_bars,
)
from specgraph.bench.systems import SpecgraphSystem
from specgraph.errors import RecipeError, SpecgraphError
from specgraph.graph import SpecGraph
from specgraph.lower import build_drafter, build_engine, build_verifier, stage_over
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.recipe import DynamicTree
from specgraph.runtime.clock import best_seconds
from specgraph.runtime.graphs import CapturedGraph
from specgraph.runtime.verifier import Verifier
from specgraph.tree import Tree


@dataclass(frozen=True, order=True)
class Candidate:
    width: int
    depth: int
    nodes: int

    def tree(self) -> DynamicTree:
        return DynamicTree(shape="dynamic", width=self.width, depth=self.depth, nodes=self.nodes)  # (shape set: dumped)

    def __str__(self) -> str:
        return f"w{self.width} d{self.depth} n{self.nodes}"


def grid(widths: list[int], depths: list[int], nodes: list[int], max_nodes: int) -> list[Candidate]:
    """Dynamic trees of each width and depth with each node count, cut to the nodes that width and
    depth grow and to `max_nodes`; none deeper than its node count (a tree of n nodes is at most n
    deep: further expansion steps would cost drafting and add no deeper node)."""
    found = set()
    for width, depth, count in itertools.product(widths, depths, nodes):
        count = min(count, width + (depth - 1) * width ** 2, max_nodes)
        if count >= depth:
            found.add(Candidate(width, depth, count))
    return sorted(found)


@dataclass(frozen=True)
class Measurement:
    candidate: Candidate
    accepted: float  # tokens per target step: accepted drafts + the bonus
    draft_seconds: float  # the draft phase, per step
    verify_seconds: float  # the target's forward of the tree and its root (nodes + 1 tokens)
    measured_tokens_per_second: float  # the executor's decode tokens/s in that run, beside the estimate

    @property
    def tokens_per_second(self) -> float:
        """The estimate the rules compare."""
        return self.accepted / (self.draft_seconds + self.verify_seconds)

    def epsilon(self, one_token: float) -> float:
        """How much more than a one-token forward (`one_token` seconds) verifying the tree costs."""
        return self.verify_seconds / one_token - 1


def choose(measurements: list[Measurement], one_token: float, rule: str,
           epsilon: float | None = None) -> tuple[Measurement | None, str]:
    """The candidate `rule` picks and why; None, and why, where none qualifies. `one_token`: seconds
    of the target's one-token forward; `epsilon`: bole's budget."""
    ranked = sorted(measurements, key=lambda m: (-m.tokens_per_second, m.candidate.nodes))
    alone = 1 / one_token  # the target decoding alone: one token per one-token forward
    if rule == "throughput":
        best = ranked[0]
        runner_up = f"; next: {ranked[1].candidate}, {ranked[1].tokens_per_second:.1f}" if len(ranked) > 1 else ""
        beats = "" if best.tokens_per_second > alone else " (none beats the target alone on this machine)"
        return best, (f"the highest expected tokens/s, {best.tokens_per_second:.1f}{runner_up}; "
                      f"the target alone: {alone:.1f}{beats}")
    within = [m for m in ranked if m.epsilon(one_token) <= epsilon]
    if not within:
        cheapest = min(measurements, key=lambda m: m.verify_seconds)
        return None, (f"no candidate verifies within {1 + epsilon:.2f} one-token forwards (--epsilon {epsilon}): the "
                      f"cheapest, {cheapest.candidate}, costs {1 + cheapest.epsilon(one_token):.2f}; raise --epsilon "
                      "or add smaller trees (--nodes)")
    largest = max(within, key=lambda m: m.candidate.nodes)  # the first of the largest in `ranked`: the fastest
    return largest, (f"the largest tree ({largest.candidate.nodes} nodes) whose verification costs at most "
                     f"{1 + epsilon:.2f} one-token forwards (it costs {1 + largest.epsilon(one_token):.2f}); of that "
                     f"size, the highest expected tokens/s ({largest.tokens_per_second:.1f})")


def bole_candidates(candidates: list[Candidate], verify: dict[int, float], epsilon: float) -> list[Candidate]:
    """The candidates the bole rule can choose, known once verification is timed (`verify`: T ->
    seconds of a T-token forward): those with the most nodes among the trees whose verification
    costs at most (1 + epsilon) one-token forwards; a one-line error where no tree does."""
    within = [c for c in candidates if verify[c.nodes + 1] <= (1 + epsilon) * verify[1]]
    if not within:
        cheapest = min(candidates, key=lambda c: verify[c.nodes + 1])
        raise SpecgraphError(f"--rule bole: no candidate verifies within {1 + epsilon:.2f} one-token forwards "
                             f"(--epsilon {epsilon}): the cheapest, {cheapest}, costs "
                             f"{verify[cheapest.nodes + 1] / verify[1]:.2f}; raise --epsilon or add smaller trees "
                             "(--nodes)")
    most = max(c.nodes for c in within)
    return [c for c in within if c.nodes == most]


@torch.inference_mode()
def verification_seconds(verifier: Verifier, sizes: list[int], context: list[int], position: int) -> dict[int, float]:
    """T -> seconds of the target's forward of T tokens, for T in `sizes`: a chain rooted at
    context[position - 1], with context[:position - 1] in the cache (context: position - 1 +
    max(sizes) tokens)."""
    stage, device = verifier.stage, verifier.device
    stage.table[0] = 1 + torch.arange(stage.table.shape[1], device=device)  # row 0 owns blocks of its own
    verifier.prefill(torch.tensor(context[:position], device=device))
    row, length = torch.zeros(1, dtype=torch.long, device=device), torch.tensor([position], device=device)
    seconds = {}
    for t in sizes:
        chain = Tree(torch.tensor([context[position - 1 : position - 1 + t]], device=device),
                     torch.arange(-1, t - 1, device=device)[None])  # [1, T]: the root, then T - 1 drafts
        forward = functools.partial(verifier.score, chain, row, length, stage.width(position, t))
        if stage.static_shapes:  # a GPU step replays its forward in a CUDA graph (here with a memory pool of its own,
            forward = CapturedGraph.record(forward, (), None)[0]  # freed with it: the stage's pool ends with its last graph)
        seconds[t] = best_seconds(forward, device, calls=5, warmup=3)
    return seconds


@dataclass
class TuneSpec:
    prompts: list[dict]  # {"id", "prompt"}
    max_new_tokens: int
    candidates: list[Candidate]
    rule: str = "throughput"
    epsilon: float | None = None  # bole: verification may cost (1 + epsilon) one-token forwards
    widen: str | None = None  # a real model's shape for the target (as `specgraph bench --widen`)


@dataclass
class TuneReport:
    device: str
    stage: int  # the drafting stage's index in the recipe
    position: int  # committed tokens when verification was timed
    verify_seconds: dict[int, float]  # T -> the target's forward of T tokens
    measurements: list[Measurement]
    chosen: Measurement | None
    reason: str


def run_tune(graph: SpecGraph, spec: TuneSpec) -> TuneReport:
    """Measure every candidate of `spec` with the planned recipe's models (one process, serial
    execution) and choose by its rule; progress goes to stderr."""
    recipe, target = graph.recipe, graph.target
    drafter = graph.drafter_of(target)
    if drafter is None:
        raise SpecgraphError(f"tune: recipe {recipe.name} has no drafting stage (stage {target} decodes alone); "
                             "tune sizes a drafter's tree: give a recipe with a drafter and a target that verifies it")
    index = graph.node(drafter)["index"]
    plans = {}
    for candidate in spec.candidates:  # every refusal (a hybrid target's step size) before any loading
        try:
            plans[candidate] = plan(recipe.with_tree(index, candidate.tree()))
        except RecipeError as exc:
            raise SpecgraphError(f"tune: candidate tree {candidate}: {exc}") from None
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    with Program(graph, widen=spec.widen) as program:
        encoded = [program.encode(row["prompt"]) for row in spec.prompts]
        for row, ids in zip(spec.prompts, encoded):
            if not 0 < len(ids) < recipe.max_seq_len:
                raise SpecgraphError(f"--prompts: prompt {row['id']} has {len(ids)} tokens; prompts need 1 to "
                                     f"{recipe.max_seq_len - 1} (max_seq_len {recipe.max_seq_len})")
        top = max(c.nodes for c in spec.candidates) + 1
        sizes = sorted({1 << k for k in range(top.bit_length())} | {c.nodes + 1 for c in spec.candidates})
        position = min(round(statistics.mean(map(len, encoded))) + spec.max_new_tokens // 2, recipe.max_seq_len)
        context = list(itertools.islice(itertools.cycle(itertools.chain(*encoded)), position - 1 + top))
        largest = next(p for c, p in plans.items() if c.nodes + 1 == top)  # its target's cache holds every size
        console.print(f"timing the target's verification of 1 to {top} tokens at position {position}")
        timed = {target: stage_over(largest, target, program.stages[target].model)}
        verify = verification_seconds(build_verifier(largest, timed), sizes, context, position)
        del timed  # (its cache, before the candidates')
        for t, seconds in verify.items():
            console.print(f"  {t:4d} tokens: {seconds * 1e3:8.3f} ms ({seconds / verify[1]:.2f}x one token)")
        if spec.rule == "bole":  # only the largest trees within the budget can be chosen: measure only those
            kept = bole_candidates(list(plans), verify, spec.epsilon)
            console.print(f"bole: {len(kept)} of {len(plans)} candidates have the most nodes ({kept[0].nodes}) "
                          f"within {1 + spec.epsilon:.2f} one-token forwards; measuring those")
            plans = {c: plans[c] for c in kept}
        measurements = measure_candidates(program, plans, spec, encoded, verify, console)
        device = device_name(program.stages[target].device)
    chosen, reason = choose(measurements, verify[1], spec.rule, spec.epsilon)
    return TuneReport(device, index, position, verify, measurements, chosen, reason)


def measure_candidates(program: Program, plans: dict[Candidate, SpecGraph], spec: TuneSpec, encoded: list[list[int]],
                       verify: dict[int, float], console: Console) -> list[Measurement]:
    """Each candidate's engine, over `program`'s lowered models, decoding the prompts, every step with
    the candidate's tree (where a policy would choose plain steps or shallower trees)."""
    bench = BenchSpec(program.recipe, spec.prompts, spec.max_new_tokens, repeats=1, baselines=())
    measurements = []
    with progress_bars(console, transient=True) as progress:
        for number, (candidate, candidate_plan) in enumerate(plans.items(), start=1):
            stages = {name: stage_over(candidate_plan, name, program.stages[name].model)
                      for name in candidate_plan.stages()}
            engine = build_engine(candidate_plan, build_verifier(candidate_plan, stages),
                                  build_drafter(candidate_plan, stages), speculation="always")
            system = SpecgraphSystem(str(candidate), engine, f"tree {candidate}", program.recipe.sampling.seed)
            result = measure_system(system, bench, encoded, progress)
            progress.remove_task(progress.task_ids[-1])
            m = Measurement(candidate, result["mean_accepted_length"], result["draft_step_ms"] / 1e3,
                            verify[candidate.nodes + 1], result["tokens_per_second"]["median"])
            measurements.append(m)
            progress.console.print(
                f"{number}/{len(plans)} {candidate}: {m.accepted:.2f} accepted/step, draft {m.draft_seconds * 1e3:.3f} "
                f"ms, verify {m.verify_seconds * 1e3:.3f} ms -> expected {m.tokens_per_second:.1f} tokens/s "
                f"(measured {m.measured_tokens_per_second:.1f})")
            del stages, system
            gc.collect()  # (compiled methods tie an executor to itself: free its caches before the next one's)
    return measurements


def print_report(report: TuneReport, spec: TuneSpec, console: Console | None = None) -> None:
    console = console or Console()
    one_token = report.verify_seconds[1]
    table = Table(title=f"tune on {report.device}: {len(spec.prompts)} prompts x {spec.max_new_tokens} tokens, "
                        f"verification timed at position {report.position}")
    for column in ("candidate", "nodes", "accepted/step", "draft ms", "verify ms", "expected tok/s",
                   "measured tok/s", "epsilon"):
        table.add_column(column, overflow="fold", no_wrap=column == "candidate")
    table.add_row("target alone", "0", "1.00", "—", f"{one_token * 1e3:.3f}", f"{1 / one_token:.1f}", "—", "0.000")
    for m in report.measurements:
        mark = " *" if m is report.chosen else ""
        table.add_row(f"{m.candidate}{mark}", str(m.candidate.nodes), f"{m.accepted:.2f}",
                      f"{m.draft_seconds * 1e3:.3f}", f"{m.verify_seconds * 1e3:.3f}", f"{m.tokens_per_second:.1f}",
                      f"{m.measured_tokens_per_second:.1f}", f"{m.epsilon(one_token):.3f}")
    console.print(table)
    console.print("candidate: dynamic tree of width w, depth d, n nodes; accepted/step: tokens per target step; "
                  "draft ms: the draft phase per step; verify ms: the target's forward of n + 1 tokens; expected "
                  "tok/s: accepted / (draft + verify); measured tok/s: the executor's decode rate on these prompts; "
                  "epsilon: verify / (one-token verify) - 1", highlight=False, soft_wrap=True)
    if report.chosen is not None:
        m = report.chosen
        console.print(f"chosen ({spec.rule} rule): {m.candidate}, measured epsilon {m.epsilon(one_token):.3f}: "
                      f"{report.reason}", highlight=False, soft_wrap=True)
