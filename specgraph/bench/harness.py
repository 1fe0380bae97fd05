"""`specgraph bench`: the recipe and its baselines on the same models, prompts and device, in one
process run, with the ratios computed from the times measured here."""

from __future__ import annotations

import gc
import hashlib
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from specgraph.bench.pipespec import stage_table
from specgraph.bench.systems import HFSystem, Run, SpecgraphSystem, hf_mirror
from specgraph.errors import RecipeError, SpecgraphError
from specgraph.quant.linear import weights_of
from specgraph.graph import SpecGraph
from specgraph.models.loader import is_hybrid
from specgraph.passes.place import resolve_device, world_size
from specgraph.lower import build_executor, stage_over
from specgraph.passes import plan
from specgraph.program import Program
from specgraph.recipe import ChainTree, Recipe, StageSpec
from specgraph.runtime.clock import best_seconds
from specgraph.runtime.executor import total_stats

BASELINES = ("hf", "hf-assisted", "ar", "serial")


@dataclass
class BenchSpec:
    recipe: Recipe
    prompts: list[dict]  # {"id", "prompt"}
    max_new_tokens: int
    repeats: int = 3
    baselines: tuple[str, ...] = ("hf", "hf-assisted", "ar")
    widen: str | None = None  # target shape; the drafter widens to the small shape with its head dim
    warmup: int | None = None  # prompts in the untimed first pass (None: all of them)
    overrides: tuple[str, ...] = ()  # the command's --set (and lowering flags; model paths relative to the recipe's
    # folder made whole): recipe-file baselines load with them


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, copies: int = 10) -> float:
    """Bytes read + written per second by device-to-device copies of `nbytes`: the best of 5
    timings of `copies` back-to-back copies after a warm-up one, timed as a step's phases are
    (`best_seconds`): on a GPU by CUDA events, so no launch or host synchronisation is counted (timed
    from the host, a single 1 GiB copy measured 2.5% less bandwidth on an H200, and varied more:
    docs/benchmarks.md); on the CPU, one copy per timing, by the host clock."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), device, copies if device.type == "cuda" else 1)


def unique_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's state: parameters and stored buffers (a quantized projection's packed
    weight, scales and zeros: specgraph/quant/linear.py), tied tensors counted once."""
    tensors = module.state_dict(keep_vars=True).values()
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def run_bench(spec: BenchSpec) -> dict:
    """Load the recipe's program (its processes, where it has several: the bench then runs in
    rank 0, beside the target) and measure it and the baselines."""
    if spec.max_new_tokens < 2:
        raise SpecgraphError(f"--max-new-tokens: bench measures decoding after the first token; give at least 2 "
                             f"(got {spec.max_new_tokens})")
    repeated = next((b for i, b in enumerate(spec.baselines) if b in spec.baselines[:i]), None)
    if repeated is not None:
        raise SpecgraphError(f"--baselines: {repeated} is given twice; name each system once")
    graph = plan(spec.recipe)
    variants = tree_variants(spec, graph)
    program = Program(graph, systems=tuple(b for b in spec.baselines if b in ("ar", "serial")), widen=spec.widen)
    try:
        if program.cluster is not None:
            return program.cluster.call(bench_on, spec)
        return bench_on(program, spec, variants)
    finally:
        program.close()


def tree_variants(spec: BenchSpec, graph: SpecGraph) -> dict[str, SpecGraph]:
    """The plans of the recipe files among the baselines (loaded with the command's overrides),
    checked before any model loads: each differs from the recipe (planned as `graph`) only in its
    stages' trees (what `specgraph tune` writes), so it runs over the recipe's loaded models."""
    variants = {}
    for name in spec.baselines:
        if name in BASELINES:
            continue
        if not name.lower().endswith((".yaml", ".yml")):
            raise SpecgraphError(f"--baselines: unknown {name!r}; valid: {', '.join(BASELINES)}, or a recipe file "
                                 "(.yaml) that differs from the recipe only in its stages' trees")
        if spec.recipe.execution != "serial" or world_size(graph) > 1:
            raise SpecgraphError(f"--baselines {name}: a recipe file runs beside a serial recipe in one process; "
                                 f"recipe {spec.recipe.name} runs {spec.recipe.execution} over {world_size(graph)} "
                                 "processes")
        try:
            other = Recipe.from_yaml(name, spec.overrides)
            difference = _difference(spec.recipe, other)
            if difference is not None:
                raise SpecgraphError(f"--baselines {name}: differs from the recipe in {difference}; a recipe baseline "
                                     "runs over the recipe's loaded models (the command's --set applies to both), so "
                                     "only its stages' trees may differ")
            variants[name] = plan(other)
        except RecipeError as exc:
            raise SpecgraphError(f"--baselines {name}: {exc}") from None
    return variants


def _difference(recipe: Recipe, other: Recipe) -> str | None:
    """Where `other` differs from `recipe` ("field (its value; the recipe's: value)"), leaving out
    the name, the prompt, max_new_tokens and the stages' trees (model paths compared resolved);
    None where it does not."""
    def shown(value, other_value) -> str:  # (of a recipe section, the keys where the two differ)
        if hasattr(value, "model_dump"):
            value, other_value = value.model_dump(), other_value.model_dump()
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v != other_value.get(k)}
        return str(value) if len(str(value)) <= 80 else str(value)[:77] + "..."

    names = [[stage.name for stage in r.stages] for r in (other, recipe)]
    if names[0] != names[1]:
        return f"its stages ({', '.join(names[0])}; the recipe's: {', '.join(names[1])})"
    pairs = [(f"stages.{i}.{key}", getattr(ours, key), getattr(theirs, key))
             for i, (ours, theirs) in enumerate(zip(recipe.stages, other.stages))
             for key in StageSpec.model_fields if key != "tree"]
    for key in Recipe.model_fields:
        if key not in ("name", "prompt", "max_new_tokens", "stages"):
            ours, theirs = getattr(recipe, key), getattr(other, key)
            if key == "models":
                ours, theirs = ({k: f"{m.path.resolve()} ({m.dtype})" for k, m in models.items()}
                                for models in (ours, theirs))
            pairs.append((key, ours, theirs))
    return next((f"{field} ({shown(theirs, ours)}; the recipe's: {shown(ours, theirs)})"
                 for field, ours, theirs in pairs if ours != theirs), None)


def build_systems(program, spec: BenchSpec,
                  variants: dict[str, SpecGraph] | None = None) -> tuple[list, dict[str, str]]:
    """Every requested system that can run beside `program` (a one-process Program, or rank 0's
    Worker of a multi-process one), and the reasons for those that cannot; `variants`: the plans of
    the recipe-file baselines (tree_variants)."""
    graph = program.graph
    target_node = graph.node(graph.target)
    drafter = graph.drafter_of(graph.target)
    execution, seed = spec.recipe.execution, spec.recipe.sampling.seed

    def how(step_graphs: bool, node: dict = target_node) -> str:
        steps = "CUDA graphs per step" if step_graphs else (
            "CUDA graphs per forward" if node["graph_buckets"] else "eager forwards")
        return ", ".join((["compiled layers"] if node["compile"] else []) + [steps])

    systems = [SpecgraphSystem("specgraph", program.system("specgraph"),
                               f"recipe {spec.recipe.name}, {execution} executor, "
                               f"{how(target_node['step_graphs'])}, {_gpus(graph)}", seed)]
    skipped: dict[str, str] = {}
    target_model = program.stages[graph.target].model if graph.target in program.stages else None
    hf_target = None
    for name in spec.baselines:
        if name not in BASELINES:  # a recipe file (tree_variants refused any other name)
            variant = variants[name]
            node = variant.node(variant.target)
            described = (f"trees {_trees(variant)} over the recipe's models, serial executor, "
                         f"{how(node['step_graphs'], node)}, {_gpus(variant)}")
            systems.append(Deferred(name, partial(_variant_system, name, variant, program, described, seed)))
        elif name == "ar":
            systems.append(SpecgraphSystem("ar", program.system("ar"), f"specgraph, target alone, serial, "
                                           f"{how(target_node['alone_step_graphs'])}, {_gpus(graph, alone=True)}", seed))
        elif name == "serial":
            if execution == "serial":
                skipped[name] = "the recipe already runs on the serial executor"
            else:
                systems.append(SpecgraphSystem("serial", program.system("serial"),
                                               f"the recipe on the serial executor, every stage on the target's devices, "
                                               f"{_gpus(graph, alone=True)}", seed))
        elif target_node["tp"] > 1:
            skipped[name] = f"transformers baselines run on one device; the target is tensor-parallel over {target_node['tp']}"
        elif target_node["rule"] != "greedy":
            skipped[name] = "transformers baselines are measured greedy; the recipe samples"
        elif name == "hf-assisted" and drafter is None:
            skipped[name] = "the recipe has no drafter"
        elif name == "hf-assisted" and drafter not in program.stages:
            skipped[name] = "transformers' assisted generation needs the drafter in the target's process"
        elif name == "hf-assisted" and is_hybrid(target_node["config"]):
            skipped[name] = "transformers' assisted generation refuses hybrid (recurrent-state) models"
        else:
            hf_target = hf_target or hf_mirror(target_model, target_node["config"])
            assistant = None
            if name == "hf-assisted":
                assistant = hf_mirror(program.stages[drafter].model, graph.node(drafter)["config"])
            systems.append(HFSystem(name, hf_target, target_node["eos_ids"], target_model.served_vocab, assistant,
                                    static_cache=name == "hf"))
    return systems, skipped


@dataclass
class Deferred:
    """A system built when it is measured and freed after it: a recipe file's caches and captured
    graphs stay out of the other systems' memory."""
    name: str
    build: Callable[[], SpecgraphSystem]


def _variant_system(name: str, variant: SpecGraph, program, description: str, seed: int) -> SpecgraphSystem:
    """The recipe file `name`, planned as `variant`, over `program`'s loaded models (as `specgraph
    tune` runs its candidates): fresh caches of its plan's sizes."""
    stages = {stage: stage_over(variant, stage, program.stages[stage].model) for stage in variant.stages()}
    return SpecgraphSystem(name, build_executor(variant, stages), description, seed)


def _trees(graph: SpecGraph) -> str:
    """The planned drafting stages' trees in a few words: `(draft: dynamic width=4 depth=3 nodes=8)`."""
    described = []
    for name in graph.stages():
        node = graph.node(name)
        if node["tree"] is not None:
            tree = (node["spec"].tree or ChainTree()).model_dump(exclude_none=True)
            described.append(f"{name}: {tree.pop('shape')} " + " ".join(f"{k}={v}" for k, v in tree.items()))
    return f"({'; '.join(described)})"


def _gpus(graph, alone: bool = False) -> str:
    """How many GPUs a system uses: the recipe's (every stage's devices), or the target's alone."""
    names = [graph.target] if alone else graph.stages()
    listed = {resolve_device(d, "") for name in names for d in graph.node(name)["spec"].devices}  # (auto: a GPU where present)
    gpus = {d for d in listed if d.type == "cuda"}
    return f"{len(gpus)} GPU{'s' if len(gpus) != 1 else ''}" if gpus else "CPU"


def progress_bars(console: Console | None = None, transient: bool = False) -> Progress:
    """A bar per measured system: its name, the prompts it has decoded, the time so far."""
    return Progress(TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=transient)


def measure_system(system, spec: BenchSpec, encoded: list[list[int]], progress: Progress) -> dict:
    """`system` decoding the prompts: an untimed pass over the first `spec.warmup` (compilation and
    graph capture happen there), then `spec.repeats` timed ones over all; decode tokens/s per
    repeat, and the last repeat's steps."""
    device = system.device
    warmup = encoded[: spec.warmup]
    task = progress.add_task(system.name, total=len(warmup) + spec.repeats * len(encoded))
    for ids in warmup:  # an untimed pass first: graph capture and compilation happen here, per shape
        system.run(ids, spec.max_new_tokens)
        progress.advance(task)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    repeats: list[list[Run]] = []
    for _ in range(spec.repeats):
        runs = []
        for ids in encoded:
            runs.append(system.run(ids, spec.max_new_tokens))
            progress.advance(task)
        repeats.append(runs)
    # decode tokens/s: tokens after the first step over the time after it (prefill is in TTFT)
    if not sum(r.decode_tokens for r in repeats[0]):
        raise SpecgraphError(f"{system.name}: every prompt ended at its first token (end of sequence): there is no "
                             "decoding to measure; give other prompts")
    decode_tokens = [sum(r.decode_tokens for r in runs) for runs in repeats]
    decode_seconds = [sum(r.decode_seconds for r in runs) for runs in repeats]
    tps = [tokens / seconds for tokens, seconds in zip(decode_tokens, decode_seconds)]
    last = repeats[-1]
    steps = [n for r in last for n in r.accepted_lengths]
    n_steps = len(steps) or None
    return {
        "description": system.description,
        "tokens_per_second": {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "runs": tps},
        "decode_tokens": decode_tokens, "decode_seconds": decode_seconds,  # per repeat (what `specgraph report` merges)
        "new_tokens": sum(len(r.output_ids) for r in last),
        "ttft_seconds": statistics.median(r.first_token_seconds for r in last),
        "first_token_seconds": [r.first_token_seconds for r in last],  # per prompt
        "mean_accepted_length": sum(steps) / n_steps if n_steps else None,
        "accepted_lengths": steps,
        "draft_step_ms": 1e3 * sum(r.draft_seconds for r in last) / n_steps if n_steps else None,
        "verify_step_ms": 1e3 * sum(r.verify_seconds for r in last) / n_steps if n_steps else None,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "outputs": [r.output_ids for r in last],
        **executor_stats(total_stats(r.stats for r in last)),
    }


def executor_stats(stats: dict[str, float]) -> dict:
    """An executor's own statistics summed over the prompts (Generation.stats, key by key) -> a
    system's fields in a report: the sums (`specgraph report` adds up its parts') and, for an
    asynchronous executor, the figures computed from them (see _overlap, pipespec.stage_table)."""
    table = stage_table(stats)
    return {"executor_stats": stats, **({"pipeline": table} if table is not None else _overlap(stats))}


def _overlap(stats: dict[str, float]) -> dict:
    """What a disaggregated executor measured (summed over the prompts): the share of the draft's
    work done while the target verified, how often a tree's subtree survived its verdict, and how
    busy each side was (the rest of its time it waited for the other)."""
    if "rounds" not in stats:
        return {}
    draft_work = stats["draft_hidden_seconds"] + stats["draft_critical_seconds"]
    return {"overlap": {
        "hidden_draft_share": stats["draft_hidden_seconds"] / draft_work if draft_work else None,
        "survival_rate": stats["survived"] / stats["rounds"] if stats["rounds"] else None,
        "target_busy_share": stats["target_verify_seconds"] / (stats["target_verify_seconds"] + stats["target_wait_seconds"]),
        "draft_busy_share": draft_work / (draft_work + stats["draft_idle_seconds"]),
        "rounds": stats["rounds"], "survived": stats["survived"],
        **{key: stats[key] for key in ("target_verify_seconds", "target_wait_seconds", "draft_hidden_seconds",
                                      "draft_critical_seconds", "draft_idle_seconds")}}}


def bench_on(program, spec: BenchSpec, variants: dict[str, SpecGraph] | None = None) -> dict:
    """The measurements of `spec` beside `program`'s target (see build_systems)."""
    systems, skipped = build_systems(program, spec, variants)
    encoded = [program.encode(p["prompt"]) for p in spec.prompts]
    device = program.stages[program.graph.target].device
    results = {}
    with progress_bars() as progress:
        for system in systems:
            deferred = isinstance(system, Deferred)
            system = system.build() if deferred else system
            try:
                results[system.name] = measure_system(system, spec, encoded, progress)
                progress.console.print(_summary_line(system.name, results[system.name]), highlight=False,
                                       markup=False, soft_wrap=True)
            except Exception as exc:  # a transformers baseline failing here is reported; ours never are caught
                if not isinstance(system, HFSystem):
                    raise
                first_line = (str(exc).splitlines() or [""])[0][:200]
                skipped[system.name] = f"transformers failed in this run: {type(exc).__name__}: {first_line}"
            if deferred:
                del system
                gc.collect()  # (compiled methods tie an executor to itself: free its caches before the next system)
    reference = results["ar"]["outputs"] if "ar" in results else None
    samples = spec.recipe.sampling.temperature > 0  # sampled tokens need not equal ar's (nor ar's its own greedy ones)
    for result in results.values():  # (None where ar did not run, or the recipe samples)
        outputs = result.pop("outputs")
        result["same_tokens_as_ar"] = (None if reference is None or samples
                                       else sum(map(list.__eq__, outputs, reference)) / len(reference))
    report = {
        "recipe": spec.recipe.name, "settings": recipe_settings(spec.recipe), "widen": spec.widen,
        "weights": {name: weights_of(stage.model) for name, stage in program.stages.items()},
        "device": device_name(device),
        "date": time.strftime("%Y-%m-%d"), "prompts": len(encoded),
        "prompt_ids": [p["id"] for p in spec.prompts],  # (and the texts' digests: `specgraph report` refuses parts
        "prompt_digests": [hashlib.sha256(p["prompt"].encode()).hexdigest() for p in spec.prompts],  # that share one)
        "max_new_tokens": spec.max_new_tokens,
        "repeats": spec.repeats, "warmup_prompts": len(spec.prompts[: spec.warmup]), "systems": results, "skipped": skipped,
        "speedup": speedups(results),
    }
    if "ar" in results:
        report["bandwidth_bound"] = _bandwidth_bound(program, device, encoded, results["ar"])
    return report


def recipe_settings(recipe: Recipe) -> dict:
    """Every field of the recipe as measured (the command's --set applied, defaults filled in, model
    paths resolved): what parts of one benchmark must share (`specgraph report`)."""
    settings = recipe.model_dump(mode="json")
    for name, model in recipe.models.items():
        settings["models"][name]["path"] = str(model.path.resolve())
    return settings


def speedups(results: dict[str, dict]) -> dict[str, float]:
    """specgraph's median decode tokens/s over each other system's."""
    ours = results["specgraph"]["tokens_per_second"]["median"]
    return {name: ours / r["tokens_per_second"]["median"] for name, r in results.items() if name != "specgraph"}


def _summary_line(name: str, result: dict) -> str:
    """One system's figures as soon as it is measured (a run stopped before its table keeps them)."""
    tps = result["tokens_per_second"]["median"]
    steps = "" if result["mean_accepted_length"] is None else (
        f", {result['mean_accepted_length']:.2f} accepted, draft / verify {result['draft_step_ms']:.2f} / "
        f"{result['verify_step_ms']:.2f} ms per step")
    return f"{name}: {tps:.1f} tok/s{steps}"


def _bandwidth_bound(program: Program, device: torch.device, encoded: list[list[int]], ar: dict) -> dict:
    mean_context = statistics.mean(len(ids) for ids in encoded) + ar["new_tokens"] / len(encoded) / 2
    weight_bytes, state_bytes, kv_per_position = step_bytes(program)
    bytes_per_token = weight_bytes + kv_per_position * mean_context + 2 * state_bytes
    return bandwidth_bound(measure_copy_bandwidth(device), bytes_per_token, weight_bytes, ar)


def step_bytes(program: Program) -> tuple[int, int, int]:
    """What autoregressive decoding reads besides activations: (the bytes of every weight, read once
    a step, of the embedding table one row unless the head shares it; of a request's cache besides
    K/V (a hybrid's DeltaNet states and conv windows), read and written each token; of K/V a position
    of its context)."""
    model = program.stages[program.graph.target].model
    shape, itemsize = model.shape, model.embed_tokens.weight.element_size()
    weight_bytes = unique_bytes(model)
    if model.lm_head.weight is not model.embed_tokens.weight:
        weight_bytes -= (shape.vocab_size - 1) * shape.hidden_size * itemsize
    return weight_bytes, shape.cache_bytes(0, itemsize), shape.kv_bytes_per_slot(itemsize)


def bandwidth_bound(bandwidth: float, bytes_per_token: float, weight_bytes: int, ar: dict) -> dict:
    """The bound's figures in a report: `bandwidth` bytes/s over `bytes_per_token`, and ar's share of it."""
    bound = bandwidth / bytes_per_token
    return {"copy_bandwidth_bytes_per_s": bandwidth, "bytes_per_token": bytes_per_token,
            "weight_bytes": weight_bytes, "tokens_per_second": bound,
            "ar_fraction": ar["tokens_per_second"]["median"] / bound}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
