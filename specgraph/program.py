"""A Program: a recipe planned, lowered (lower.py) and ready to decode, in this process or in the
processes its plan needs (launch.py); it turns text into token ids and back at its edges."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from specgraph.engine.engine import Engine
from specgraph.errors import PromptError, SpecgraphError
from specgraph.graph import SpecGraph
from specgraph.lower import build_engine, build_executor, load_stage, widened_models
from specgraph.passes import plan
from specgraph.passes.place import world_size
from specgraph.recipe import Recipe
from specgraph.runtime.executor import Executor, Generation
from specgraph.text import Tokenizer


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
        self.tokenizer = Tokenizer(graph.node(graph.target)["model"].path)
        self.cluster = None
        if world_size(graph) == 1:
            models = models or widened_models(graph, graph.stages(), widen)
            self.stages = {name: load_stage(graph, name, models.get(name)) for name in graph.stages()}
            self.executor = build_executor(graph, self.stages)
            return
        if models:
            raise SpecgraphError("a multi-process program loads its models in its own processes")
        from specgraph.launch import Cluster, InProcessCluster, join_torchrun, launched_by_torchrun
        from specgraph.worker import LaunchSpec

        spec = LaunchSpec(graph, widen, ("specgraph", *systems))
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
        return build_engine(self.graph, self.executor.runner.verifier, None)

    def engine(self, speculation: str | None = None, epsilon: float | None = None) -> Engine:
        """Another engine of the recipe on the same loaded stages: `speculation` (adaptive, always) in
        place of the recipe's serving.speculation, `epsilon` in place of its budget's (recalibrated)."""
        runner = self.executor.runner
        return build_engine(self.graph, runner.verifier, runner.drafter, speculation, epsilon)

    def close(self, now: bool = False) -> None:
        """Stop the program's processes, if it has any: after the call in progress (another thread's),
        or `now`, whatever they are doing (that call then fails)."""
        if self.cluster is not None:
            (self.cluster.stop if now else self.cluster.close)()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> Program:
        return cls(plan(recipe))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def check(self, prompt_ids: list[int], max_new_tokens: int | None) -> int:
        """A request's budget (the recipe's where None) once its prompt and budget are seen to be
        decodable; a PromptError naming what is wrong where not."""
        if not 0 < len(prompt_ids) < self.recipe.max_seq_len:
            raise PromptError(f"a prompt of {len(prompt_ids)} tokens does not fit: prompts need 1 to "
                              f"{self.recipe.max_seq_len - 1} tokens (max_seq_len {self.recipe.max_seq_len})", "prompt")
        vocab = self.graph.node(self.graph.target)["vocab"][1]
        outside = next(((i, t) for i, t in enumerate(prompt_ids) if not 0 <= t < vocab), None)
        if outside is not None:
            raise PromptError(f"prompt token {outside[1]} (at {outside[0]}) is outside the vocabulary: ids are 0 to "
                              f"{vocab - 1}", "prompt")
        if max_new_tokens is None:
            max_new_tokens = self.recipe.max_new_tokens
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise PromptError(f"max_new_tokens: must be a whole number of at least 1 (got {max_new_tokens!r})",
                              "max_new_tokens")
        return max_new_tokens

    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None, seed: int | None = None) -> Generation:
        max_new_tokens = self.check(prompt_ids, max_new_tokens)
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
                pending[engine.add_request(ids, self.check(ids, max_new_tokens), sampling).id] = index
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
        from specgraph.worker import generate_on

        return self.cluster.call(generate_on, self.system, list(prompt_ids), max_new_tokens, seed)
