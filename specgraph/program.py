"""Lowering: a planned SpecGraph becomes a Program — loaded stages wired to an executor."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from transformers import AutoTokenizer

from specgraph.draft import Drafter
from specgraph.engine.budget import Budget, batch_sizes, calibrate
from specgraph.engine.engine import Engine
from specgraph.engine.pool import BlockPool
from specgraph.engine.runner import Runner
from specgraph.errors import PromptError, SpecgraphError
from specgraph.graph import SpecGraph
from specgraph.kernels import Kernels
from specgraph.models.loader import load_model
from specgraph.parallel import shard_model
from specgraph.passes import run_pipeline
from specgraph.passes.place import world_size
from specgraph.recipe import Recipe
from specgraph.runtime.executor import Executor, Generation
from specgraph.runtime.ranks import Ranks
from specgraph.runtime.stage import Stage
from specgraph.runtime.verifier import Verifier


def plan(recipe: Recipe) -> SpecGraph:
    """Recipe -> graph -> every pass of PIPELINE."""
    return run_pipeline(SpecGraph.from_recipe(recipe))


RECOMPILE_LIMIT = 64  # compiled entries of one function in a process (see compile_model)


def compile_model(model: nn.Module) -> None:
    """Compile, in place, each decoder layer and the work before and after them (`stem`: embedding
    and rotary tables; `logits`: final norm and head). Layers share code, so Inductor compiles it
    once per shape class (T = 1, and T symbolic) and every layer reuses it. Layers get their cache
    tensors, not an index, so that nothing layer-specific is a compile-time constant.

    Every model of every program in a process shares that code: each (dtype, kernel choice, shape
    class) is one more compiled entry of it, so a process that holds several programs (`bench`'s
    baselines, `tune`'s candidates) passes Dynamo's default of 8 entries a function, past which a
    fullgraph compile fails; the limit is raised to RECOMPILE_LIMIT."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in model.layers:
        layer.compile(dynamic=True, fullgraph=True)
    model.stem = torch.compile(model.stem, dynamic=True, fullgraph=True)
    model.logits = torch.compile(model.logits, dynamic=True, fullgraph=True)


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
    model = model or _load(name, node, ranks)
    if hasattr(model, "use_kernels"):  # (an exported package has its ops built in)
        model.use_kernels(Kernels.select(node["kernels"]))
    if node["compile"]:
        compile_model(model)
    return stage_over(graph, name, model)


def stage_over(graph: SpecGraph, name: str, model: nn.Module) -> Stage:
    """Stage `name` over `model`, lowered already: a fresh cache of the plan's `cache_slots`, its
    `graph_buckets` and `static_shapes` (one lowered model serves the plans of several trees:
    `specgraph tune`)."""
    node = graph.node(name)
    paged = graph.recipe.execution == "serial"  # (the engine assigns the table's rows; the others use row 0)
    return Stage(name, model, node["cache_slots"], node["device"], node["graph_buckets"], node["static_shapes"],
                 Kernels.select(node["kernels"]), node["vocab"], node["requests"], node["kv_blocks"] if paged else None,
                 node["block_size"])


def make_executor(graph: SpecGraph, stages: dict[str, Stage], ranks: Ranks = Ranks()) -> Executor:
    """This process's executor for the `execution` the recipe names, over its loaded `stages`: the
    serial executor (on every rank of a serial program), or this rank's worker of a disaggregated
    program, or its stage of a pipeline."""
    recipe = graph.recipe
    if recipe.execution == "serial":
        return engine_of(graph, verifier_of(graph, stages), drafter_of(graph, stages))
    if recipe.execution == "disaggregated":
        from specgraph.runtime.disaggregated import disaggregated_executor

        return disaggregated_executor(graph, stages, ranks)
    if recipe.execution == "pipeline":
        from specgraph.runtime.pipeline import pipeline_executor

        return pipeline_executor(graph, stages, ranks)
    raise SpecgraphError(f"execution: {recipe.execution!r} has no executor yet")


def engine_of(graph: SpecGraph, verifier: Verifier, drafter: Drafter | None) -> Engine:
    """The engine of a serial program over its loaded verifier and drafter (None: the target alone),
    its verification budget calibrated here where the recipe asks for one and gives no table."""
    recipe, serving = graph.recipe, graph.recipe.serving
    target = graph.node(graph.target)
    region = max(graph.node(n)["cache_slots"] for n in graph.stages()) - recipe.max_seq_len
    runner = Runner(verifier, drafter, serving.max_batch, recipe.max_seq_len + region, target["compile"])
    pool = BlockPool(target["kv_blocks"], target["block_size"])
    spec, budget = target["spec"].verify.budget, None
    if spec is not None and drafter is not None:
        table = spec.nodes or calibrate(verifier, batch_sizes(serving.max_batch), drafter.nodes, spec.epsilon,
                                        min(CALIBRATION_CONTEXT, recipe.max_seq_len // 2))
        budget = Budget(table, drafter.nodes)
    return Engine(runner, target["eos_ids"], recipe.max_seq_len, serving.max_batch, pool, region,
                  serving.prefill_chunk, recipe.sampling, budget)


CALIBRATION_CONTEXT = 512  # committed tokens of each request while the budget is calibrated


def verifier_of(graph: SpecGraph, stages: dict[str, Stage], name: str | None = None) -> Verifier:
    """The Verifier of stage `name` (default: the target)."""
    name = name or graph.target
    node = graph.node(name)
    return Verifier(stages[name], node["spec"].verify, node["rule"], Kernels.select(node["kernels"]), node["compile"])


def drafter_of(graph: SpecGraph, stages: dict[str, Stage], name: str | None = None) -> Drafter | None:
    """The Drafter of the stage that stage `name` (default: the target) verifies, None if it verifies none."""
    draft_name = graph.drafter_of(name or graph.target)
    if draft_name is None:
        return None
    return Drafter(stages[draft_name], graph.node(draft_name)["tree"], graph.node(graph.target)["rule"])


def widened_models(graph: SpecGraph, names: list[str], shape: str | None, ranks: Ranks = Ranks()) -> dict[str, nn.Module]:
    """Stages `names` widened to a real model's shape (the target to `shape`, drafters to the small
    shape with their head dim: bench/widen.py), as this rank's shard where a stage is split; {}
    when `shape` is None."""
    if not shape:
        return {}
    from specgraph.bench.widen import draft_shape_for, widen, widened_shape

    plans = {}  # name -> (small model, its shape name, what it is): every misfit found before any widening
    for name in names:
        node = graph.node(name)
        small = load_model(node["model"].path, node["dtype"], "cpu")
        big = shape if name == graph.target else draft_shape_for(small.shape)
        plans[name] = small, big, f"stage {name}'s model (models.{node['spec'].model})"
        widened_shape(small.shape, big, what=plans[name][2])
    models = {}
    for name, (small, big, what) in plans.items():
        node = graph.node(name)
        models[name] = widen(small, big, node["device"], node["dtype"], shard=ranks.shard(name, node["tp"]), what=what)
    return models


class Program:
    """A recipe lowered and ready to decode. In one process: its stages loaded from the plan (or
    given as `models`, by stage name), lowered as the plan's annotations say, and the executor over
    them. Where the plan needs several processes (tensor-parallel stages, asynchronous execution):
    those processes (launch.py), each loading its own stages, and an executor that asks them; call
    `close` (or use the program as a context manager) to stop them."""

    def __init__(self, graph: SpecGraph, models: dict[str, nn.Module] | None = None, systems: tuple[str, ...] = (),
                 widen: str | None = None):
        """`systems`: the baselines (`ar`, `serial`) that a multi-process program prepares beside the
        recipe; `widen`: a real model's shape for the target (see `widened_models`)."""
        self.graph = graph
        self.recipe = graph.recipe
        self.tokenizer = AutoTokenizer.from_pretrained(graph.node(graph.target)["model"].path, trust_remote_code=False)
        self.cluster = None
        if world_size(graph) == 1:
            models = models or widened_models(graph, graph.stages(), widen)
            self.stages = {name: load_stage(graph, name, models.get(name)) for name in graph.stages()}
            self.executor = make_executor(graph, self.stages)
            return
        if models:
            raise SpecgraphError("a multi-process program loads its models in its own processes")
        from specgraph.launch import Cluster, InProcessCluster, LaunchSpec, join_torchrun, launched_by_torchrun

        spec = LaunchSpec(self.recipe, widen, ("specgraph", *systems))
        self.cluster: Cluster | InProcessCluster = join_torchrun(spec) if launched_by_torchrun() else Cluster(spec)
        self.stages = {}
        self.executor = RemoteExecutor(self.cluster, "specgraph", graph.node(graph.target)["device"])

    def system(self, name: str) -> Executor:
        """An executor of the recipe (`specgraph`) or of a baseline (`ar`: the target alone)."""
        if self.cluster is not None:
            return RemoteExecutor(self.cluster, name, self.executor.device)
        if name == "specgraph":
            return self.executor
        if name == "ar":
            return self.autoregressive()
        raise SpecgraphError(f"system {name!r}: a one-process program runs specgraph and ar")

    def autoregressive(self) -> Engine:
        """The target alone, one token per step, on the same loaded stage (the `ar` baseline)."""
        return engine_of(self.graph, self.executor.runner.verifier, None)

    def close(self) -> None:
        """Stop the program's processes, if it has any."""
        if self.cluster is not None:
            self.cluster.close()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> Program:
        return cls(plan(recipe))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _checked(self, prompt_ids: list[int], max_new_tokens: int | None) -> int:
        """A request's budget (the recipe's where None) once its prompt and budget are seen to be
        decodable; a PromptError naming what is wrong where not."""
        if not 0 < len(prompt_ids) < self.recipe.max_seq_len:
            raise PromptError(f"a prompt of {len(prompt_ids)} tokens does not fit: prompts need 1 to "
                              f"{self.recipe.max_seq_len - 1} tokens (max_seq_len {self.recipe.max_seq_len})")
        vocab = self.graph.node(self.graph.target)["vocab"][1]
        outside = next(((i, t) for i, t in enumerate(prompt_ids) if not 0 <= t < vocab), None)
        if outside is not None:
            raise PromptError(f"prompt token {outside[1]} (at {outside[0]}) is outside the vocabulary: ids are 0 to "
                              f"{vocab - 1}")
        if max_new_tokens is None:
            max_new_tokens = self.recipe.max_new_tokens
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise PromptError(f"max_new_tokens: must be a whole number of at least 1 (got {max_new_tokens!r})")
        return max_new_tokens

    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None, seed: int | None = None) -> Generation:
        max_new_tokens = self._checked(prompt_ids, max_new_tokens)
        return self.executor.generate(prompt_ids, max_new_tokens, self.recipe.sampling.seed if seed is None else seed)

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int | None = None, seed: int | None = None
                      ) -> Iterator[tuple[int, Generation | PromptError]]:
        """Decode every prompt, up to `serving.max_batch` at once (a serial program; the others one at
        a time), each with the recipe's settings and `seed`: yields (index, Generation) as each
        finishes, and (index, PromptError) for each that cannot be decoded, at once."""
        seed = self.recipe.sampling.seed if seed is None else seed
        if not isinstance(self.executor, Engine):
            for index, ids in enumerate(prompts):
                try:
                    yield index, self.generate(ids, max_new_tokens, seed)
                except PromptError as exc:
                    yield index, exc
            return
        engine, pending = self.executor, {}
        sampling = self.recipe.sampling.model_copy(update={"seed": seed})
        for index, ids in enumerate(prompts):
            try:
                pending[engine.add_request(ids, self._checked(ids, max_new_tokens), sampling).id] = index
            except PromptError as exc:
                yield index, exc
        try:
            while pending:
                for request in engine.step():
                    if request.finished:
                        yield pending.pop(request.id), request.generation
        finally:  # (a stop mid-way: what is still in flight leaves the engine)
            for request_id in pending:
                engine.abort(request_id)


class RemoteExecutor:
    """A system of a multi-process program, run by its ranks: each call decodes on every rank."""

    def __init__(self, cluster, system: str, device: torch.device):
        self.cluster, self.system, self.device = cluster, system, device

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        from specgraph.runtime.worker import generate_on

        return self.cluster.call(generate_on, self.system, list(prompt_ids), max_new_tokens, seed)
