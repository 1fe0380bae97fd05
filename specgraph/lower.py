"""Lowering: a planned SpecGraph's stages loaded and lowered as its annotations say, and the
executor over them — the serial executor's engine, a disaggregated program's sides, a pipeline's
peers. Below the programs, ranks and benchmarks that use it; above the runtime it assembles."""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

import torch
import torch._inductor.config
import torch._inductor.exc
from tqdm import tqdm
from torch import nn

from specgraph.models.widen import draft_shape_for, widen, widened_shape
from specgraph.draft import Drafter
from specgraph.engine.budget import Budget, batch_sizes
from specgraph.engine.calibrate import budget_table, prompt_shapes, prompt_token_seconds, step_costs, step_shapes, warm_up
from specgraph.engine.saved import device_identity, remembered, weights_layout
from specgraph.engine.engine import Engine
from specgraph.engine.policy import Policy, StepCosts
from specgraph.engine.pool import BlockPool
from specgraph.engine.runner import Mode, Runner
from specgraph.errors import SpecgraphError
from specgraph.quant.quantize import SCHEMES
from specgraph.graph import SpecGraph
from specgraph.growing import GrowingDrafter
from specgraph.head import HeadDrafter
from specgraph.kernels import Kernels
from specgraph.kernels.qlinear.tinygemm import use_tinygemm
from specgraph.models.eagle import Eagle3Head
from specgraph.models.loader import is_head, load_embedding, load_model
from specgraph.parallel import shard_model
from specgraph.passes.place import resolve_device
from specgraph.recipe import ChainTree, DynamicTree
from specgraph.runtime.disaggregated import DraftSide, VerifySide
from specgraph.runtime.executor import Executor
from specgraph.runtime.channel import Link, Mailbox
from specgraph.runtime.pipeline import MESSAGE_TOKENS, DraftingPeer, Followers, PipelinePeer, VerifyingPeer
from specgraph.runtime.ranks import Ranks
from specgraph.runtime.stage import Stage
from specgraph.runtime.verifier import Verifier
from specgraph.sampling import SamplingRows
from specgraph.tree import Growth, TreeTopology


RECOMPILE_LIMIT = 64  # compiled entries of one function in a process (see compile_model)
log = logging.getLogger("specgraph.build")  # the build's long steps, as they start (cli.py shows them)


def compile_model(model: nn.Module) -> None:
    """Compile, in place, each decoder layer and the work before and after them (`stem`: embedding
    and rotary tables; `logits`: final norm and head). Layers share code, so Inductor compiles it
    once per shape class (T = 1, and T symbolic) and every layer reuses it. Layers get their cache
    tensors, not an index, so that nothing layer-specific is a compile-time constant.

    Every model of every program in a process shares that code: each (dtype, kernel choice, shape
    class) is one more compiled entry of it, so a process that holds several programs (`bench`'s
    baselines, `tune`'s candidates) passes Dynamo's default of 8 entries a function, past which a
    fullgraph compile fails; the limit is raised to RECOMPILE_LIMIT. Inductor's coalescing analysis
    of Triton tilings is turned off: torch 2.11's fails an assertion on the verification step's fused
    kernels (pytorch/pytorch#197077, `get_pw_red_splits`; GPU run 113), and that is its workaround.
    A failed lowering's message names its arguments by type and size (`brief_lowering_errors`)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._inductor.config.triton.coalesce_tiling_analysis = False
    brief_lowering_errors()
    for layer in model.layers:
        layer.compile(dynamic=True, fullgraph=True)
    model.stem = torch.compile(model.stem, dynamic=True, fullgraph=True)
    model.logits = torch.compile(model.logits, dynamic=True, fullgraph=True)


def brief_lowering_errors() -> None:
    """Inductor's LoweringException prints each argument of the operator that failed to lower, and
    an argument's IR prints every node it was built from: on an H100, compiling the verification
    work of an int4 target under row_invariant, Inductor raised one (and caught it itself, lowering
    the operator another way) whose message took minutes to format (GPU runs 114 and 117: the build
    still formatting it at 240 s; run 118: the same test passed in 65 s with this). The message names
    each argument by type and size instead."""
    def operator_str(target, args, kwargs) -> str:
        def brief(arg) -> str:
            try:
                return f"{type(arg).__name__}{list(arg.get_size())}"
            except Exception:  # noqa: BLE001 - not an IR node with a size: its type says enough
                return type(arg).__name__
        return f"  target: {target}, args: {', '.join(brief(arg) for arg in args)}"

    torch._inductor.exc.OperatorIssue.operator_str = staticmethod(operator_str)


def _load(name: str, node: dict, ranks: Ranks) -> nn.Module:
    """The stage's model on its device; a tensor-parallel stage's shard is cut on the host first."""
    shard = ranks.shard(name, node["tp"])
    if shard is None:
        return load_model(node["model"].path, node["dtype"], node["device"])
    whole = load_model(node["model"].path, node["dtype"], "cpu")
    return shard_model(whole, *shard, f"stage {name}").to(node["device"])


def load_stage(graph: SpecGraph, name: str, model: nn.Module | None = None, ranks: Ranks = Ranks()) -> Stage:
    """Stage `name` lowered as its plan says (its `kernels`, `compile`, `cache_slots`,
    `graph_buckets` and `static_shapes`): `model` if given (widened, or an exported package), else
    loaded from its checkpoint (this rank's shard where it is tensor-parallel)."""
    node = graph.node(name)
    if node["tp"] > 1 and ranks.world == 1:
        raise SpecgraphError(f"stage {name} is tensor-parallel over {node['tp']} devices, which needs one process "
                             f"per device: `specgraph run` and `specgraph bench` start them")
    if model is None:
        log.info("loading stage %s: %s (%s) on %s", name, node["model"].path, str(node["dtype"]).removeprefix("torch."),
                 node["device"])
        model = _load(name, node, ranks)
    if hasattr(model, "use_kernels"):  # (an exported package has its ops built in)
        kernels = Kernels.select(node["kernels"])
        model.use_kernels(kernels)
        if kernels.tinygemm:  # (the Kernels that route a few rows through the copies it makes)
            use_tinygemm(model)
    if node["compile"]:
        compile_model(model)
    return stage_over(graph, name, model)


def stage_over(graph: SpecGraph, name: str, model: nn.Module) -> Stage:
    """Stage `name` over `model`, lowered already: a fresh cache of the plan's `cache_slots`, its
    `graph_buckets` and `static_shapes` (one lowered model serves the plans of several trees:
    `specgraph tune`)."""
    node, drafter = graph.node(name), graph.drafter_of(name)
    paged = graph.recipe.execution == "serial"  # (the engine assigns the table's rows; the others use row 0)
    capture = graph.node(drafter)["features"] if drafter is not None else None  # (an EAGLE-3 head's)
    return Stage(name, model, node["cache_slots"], node["device"], node["graph_buckets"], node["static_shapes"],
                 Kernels.select(node["kernels"]), node["vocab"], node["requests"], node["kv_blocks"] if paged else None,
                 node["block_size"], capture or ())


def build_executor(graph: SpecGraph, stages: dict[str, Stage], ranks: Ranks = Ranks()) -> Executor:
    """This process's executor for the `execution` the recipe names, over its loaded `stages`: the
    serial executor (on every rank of a serial program), or this rank's worker of a disaggregated
    program, or its peer of a pipeline."""
    recipe = graph.recipe
    if recipe.execution == "serial":
        return build_engine(graph, build_verifier(graph, stages), build_drafter(graph, stages), ranks=ranks)
    if recipe.execution == "disaggregated":
        return _disaggregated_side(graph, stages, ranks)
    if recipe.execution == "pipeline":
        return _pipeline_peer(graph, stages, ranks)
    raise SpecgraphError(f"execution: {recipe.execution!r} has no executor yet")


def build_engine(graph: SpecGraph, verifier: Verifier, drafter: Drafter | None, speculation: str | None = None,
                 epsilon: float | None = None, ranks: Ranks = Ranks()) -> Engine:
    """The engine of a serial program over its loaded verifier and drafter (None: the target alone).
    Where the recipe asks for a verification budget and gives no table, it is calibrated here; where
    a policy chooses each step's mode (`serving.speculation: adaptive` with a drafter), the drafter's
    shallower trees (and a head's chains) are its other speculative modes and every mode's step is
    timed here at batch sizes 1, 2, 4, ... up to serving.max_batch. `speculation` and `epsilon`
    stand for the recipe's serving.speculation and its budget's epsilon (then calibrated) where given.
    Every one of the `ranks` running the engine takes the same decisions: on the slowest rank's times."""
    recipe, serving = graph.recipe, graph.recipe.serving
    speculation = speculation or serving.speculation
    target = graph.node(graph.target)
    region = max(graph.node(n)["cache_slots"] for n in graph.stages()) - recipe.max_seq_len
    captured = target["step_graphs"] if drafter is not None else target["alone_step_graphs"]
    adaptive = speculation == "adaptive" and drafter is not None
    runner = Runner(verifier, drafter, serving.max_batch, recipe.max_seq_len + region, target["compile"], captured,
                    shallower(drafter) if adaptive else ())
    pool = BlockPool(target["kv_blocks"], target["block_size"])
    sizes = sorted({runner.step_rows(c) for c in batch_sizes(serving.max_batch)})  # (sizes a step runs as)
    context = min(CALIBRATION_CONTEXT, recipe.max_seq_len // 2)
    spec, budget = target["spec"].verify.budget, None
    agree = ranks.slowest(graph.target, runner.device)

    def kept(what: str, identity: dict, measure):
        """A timing of this engine's steps, saved for the next build of it (engine/saved.py); where
        the target runs over several ranks, measured each time (every rank must time, or none)."""
        if ranks.split(graph.target):
            return measure()
        identity = {**identity, "stages": {name: graph.node(name) for name in graph.stages()}, "sizes": sizes,
                    "weights": {stage.name: weights_layout(stage.model) for stage in runner.stages},
                    "serving": serving, "context": context, "modes": [(m.name, m.nodes) for m in runner.modes],
                    **device_identity(runner.device)}
        return remembered(what, identity, measure)
    if spec is not None and drafter is not None:
        table, epsilon = (spec.nodes, spec.epsilon) if epsilon is None else (None, epsilon)
        if not table:
            def measure() -> dict[int, int]:
                log.info("timing verification at batch sizes %s for the budget (epsilon %g)", sizes, epsilon)
                return budget_table(runner, runner.modes[1], sizes, epsilon, context, agree)

            table = kept("budget", {"epsilon": epsilon}, measure)
        budget = Budget(table, drafter.nodes)
    if captured or any(graph.node(n)["compile"] for n in graph.stages()):  # (built now, not while serving)
        steps = step_shapes(runner, serving.max_batch)
        prompts = prompt_shapes(runner, serving.max_batch, serving.prefill_chunk)
        log.info("building %d step shapes (%d modes) and %d prompt forwards: compiled%s now, not while serving",
                 len(runner.modes) * len(steps), len(runner.modes), len(prompts), " and captured" if captured else "")
        with progress_bar(len(runner.modes) * len(steps) + len(prompts), "building") as done:
            warm_up(runner, runner.modes, steps, prompts, budget, context, done)
    policy = None
    if adaptive:
        def measure() -> dict[str, dict[int, float]]:
            log.info("timing %d step modes (%s) at batch sizes %s for the speculation policy", len(runner.modes),
                     ", ".join(mode.name for mode in runner.modes), sizes)
            return step_costs(runner, runner.modes, sizes, budget, context, agree)

        costs = StepCosts(kept("step costs", {"budget": budget and budget.table}, measure))
        timed = [mode for mode in runner.modes if mode.name in costs.table]
        per_token = kept("prompt costs", {}, lambda: prompt_token_seconds(runner, serving.prefill_chunk, agree))
        policy = Policy(timed, costs, budget=budget, timed=not ranks.split(graph.target), prompt_token_seconds=per_token)
    return Engine(runner, target["eos_ids"], recipe.max_seq_len, serving.max_batch, pool, region,
                  serving.prefill_chunk, recipe.sampling, budget, policy)


@contextmanager
def progress_bar(total: int, what: str):
    """A bar of `total` parts on standard error, where the build's steps are shown (cli.py's
    build_progress) and a terminal redraws it (not in a log's lines) -> a function to call as each
    part is done (with a note on it)."""
    with tqdm(total=total, desc=f"specgraph: {what}", unit="shape", file=sys.stderr, leave=False,
              disable=not (log.isEnabledFor(logging.INFO) and sys.stderr.isatty())) as bar:
        def done(note: str) -> None:
            bar.set_postfix_str(note, refresh=False)
            bar.update()

        yield done


def shallower(drafter: Drafter) -> tuple[Mode, ...]:
    """The other speculative modes a policy chooses from: `drafter`'s tree cut to half its depth
    (rounded up) and to depth 1, deepest first (a dynamic tree keeps its width and verifies its nodes
    in proportion); for an EAGLE-3 head also chains of those depths, one node a depth (what pays at
    a full batch, where verifying a tree's siblings costs more than they give). Each feeds as many
    of the target's tokens as `drafter` (a head's steps in any mode leave the same pending pairs)."""
    tree, depth = drafter.tree, drafter.max_depth
    head = isinstance(drafter, HeadDrafter)
    kind = HeadDrafter if head else Drafter
    cuts = sorted({-(-depth // 2), 1}, reverse=True)
    modes = []
    for cut in cuts:
        if cut == depth:
            continue
        if isinstance(tree, DynamicTree):
            pool = tree.width + (cut - 1) * tree.width ** 2  # nodes that `cut` expansions make
            shape = DynamicTree(width=tree.width, depth=cut, nodes=min(pool, max(cut, -(-tree.nodes * cut // depth))))
        else:
            shape = tree.cut(cut)
        modes.append(Mode(f"depth {cut}", kind(drafter.stage, shape, drafter.rule, drafter.max_feeds)))
    if head and drafter.nodes > depth:  # (a chain recipe's cuts are its chains)
        for length in cuts:
            chain = TreeTopology.from_spec(ChainTree(length=length))
            modes.append(Mode(f"chain {length}", HeadDrafter(drafter.stage, chain, drafter.rule, drafter.max_feeds)))
    return tuple(modes)


CALIBRATION_CONTEXT = 512  # committed tokens of each request while steps are timed (the budget, the policy)


def build_verifier(graph: SpecGraph, stages: dict[str, Stage], name: str | None = None) -> Verifier:
    """The Verifier of stage `name` (default: the target)."""
    name = name or graph.target
    node = graph.node(name)
    return Verifier(stages[name], node["spec"].verify, node["rule"], Kernels.select(node["kernels"]), node["compile"])


def build_drafter(graph: SpecGraph, stages: dict[str, Stage], name: str | None = None) -> Drafter | None:
    """The Drafter of the stage that stage `name` (default: the target) verifies, None if it verifies none."""
    draft_name = graph.drafter_of(name or graph.target)
    if draft_name is None:
        return None
    stage, tree, rule = stages[draft_name], graph.node(draft_name)["tree"], graph.node(graph.target)["rule"]
    if not isinstance(stage.model, Eagle3Head):
        return Drafter(stage, tree, rule)
    stage.model.tie_embedding(stages[graph.target].model.embed_tokens.weight)
    return HeadDrafter(stage, tree, rule)


def widened_models(graph: SpecGraph, names: list[str], shape: str | None, ranks: Ranks = Ranks()) -> dict[str, nn.Module]:
    """Stages `names` widened to a real model's shape (the target to `shape`, drafters to the small
    shape with their head dim, an EAGLE-3 head to a head of `shape`: models/widen.py), as this rank's shard where a stage is split; {}
    when `shape` is None. `shape` may name a scheme of `specgraph quantize` after a colon
    (llama-3-8b:w4a16): the target's and drafters' projections are then quantized so (a head's are not)."""
    if not shape:
        return {}
    shape, _, scheme = shape.partition(":")
    if scheme and scheme not in SCHEMES:
        raise SpecgraphError(f"--widen {shape}:{scheme}: unknown quantization scheme {scheme!r}; valid: "
                             f"{', '.join(SCHEMES)} (or none: --widen {shape})")
    plans = {}  # name -> (small model, its shape name, what it is): every misfit found before any widening
    for name in names:
        node = graph.node(name)
        small = load_model(node["model"].path, node["dtype"], "cpu")
        big = shape if name == graph.target or is_head(node["config"]) else draft_shape_for(small.shape)
        plans[name] = small, big, f"stage {name}'s model (models.{node['spec'].model})"
        widened_shape(small.shape, big, what=plans[name][2])
    models = {}
    for name, (small, big, what) in plans.items():
        node = graph.node(name)
        log.info("widening stage %s to the %s shape%s on %s", name, big, f" ({scheme})" if scheme else "", node["device"])
        models[name] = widen(small, big, node["device"], node["dtype"], shard=ranks.shard(name, node["tp"]), what=what,
                             quantize=None if is_head(node["config"]) else scheme or None)
    return models


def _disaggregated_side(graph: SpecGraph, stages: dict[str, Stage], ranks: Ranks) -> VerifySide | DraftSide:
    """This rank's side of a disaggregated program (two stages: a drafter and the target)."""
    target = graph.target
    drafter = graph.drafter_of(target)
    leaders = {name: resolve_device(graph.node(name)["spec"].devices[0], "") for name in graph.stages()}
    trees, verdicts = Link(ranks, drafter, target, leaders), Link(ranks, target, drafter, leaders)
    node, draft_node = graph.node(target), graph.node(drafter)
    tree = draft_node["tree"]
    recipe = graph.recipe
    sampling = SamplingRows.of([recipe.sampling], graph.node(target if ranks.runs(target) else drafter)["device"])
    if ranks.runs(target):
        return VerifySide(build_verifier(graph, stages), trees, verdicts, drafter, draft_node["tree_nodes"],
                          draft_node["tree_depth"], node["eos_ids"], recipe.max_seq_len, node["step_graphs"],
                          sampling)
    head = stages[drafter].model
    if isinstance(head, Eagle3Head):
        if head.shares_embedding:  # (the target's is in another process: its checkpoint's)
            head.tie_embedding(load_embedding(node["model"].path).to(head.embed_tokens.weight))
        grower = HeadDrafter(stages[drafter], tree, node["rule"])
    elif isinstance(tree, Growth):
        grower = GrowingDrafter(stages[drafter], tree, sampling if node["rule"] == "sampling" else None)
    else:
        grower = Drafter(stages[drafter], tree, node["rule"])
    return DraftSide(grower, trees, verdicts, target, recipe.max_seq_len, draft_node["step_graphs"], sampling)


def _pipeline_peer(graph: SpecGraph, stages: dict[str, Stage], ranks: Ranks) -> PipelinePeer:
    """This rank's peer of a pipeline program (each stage has processes of its own: one, or one
    per device of a tensor-parallel stage)."""
    names = graph.stages()
    (name,) = [n for n in names if ranks.runs(n)]
    node, recipe = graph.node(name), graph.recipe
    index = node["index"]
    first = graph.node(names[0])
    trees = not isinstance(first["spec"].tree or ChainTree(), ChainTree)  # the first stage drafts trees
    capacity = max(MESSAGE_TOKENS, 2 * (first["tree_nodes"] + 1))  # (a tree: its tokens and parents; every rank agrees)
    leads = ranks.rank == ranks.leader(name)
    mailbox = Mailbox(ranks.mail, capacity) if leads else None
    followers = None
    if node["tp"] > 1:
        followers = Followers(ranks.groups[name], ranks.leader(name), node["device"], capacity)
    common = dict(names=names, index=index, leaders=[ranks.leader(n) for n in names], mailbox=mailbox,
                  window=node["window"] or 0, ahead=node["ahead"] or 0, synchronous=recipe.pipeline.synchronous,
                  device=node["device"], max_seq_len=recipe.max_seq_len, eos_ids=node["eos_ids"],
                  sampling=SamplingRows.of([recipe.sampling], node["device"]), followers=followers)
    if index == 0:
        drafter = Drafter(stages[name], node["tree"], graph.node(names[1])["rule"], node["feeds"])
        return DraftingPeer(drafter, trees, node["cache_slots"], **common)
    return VerifyingPeer(build_verifier(graph, stages, name), trees and index == 1, **common)
