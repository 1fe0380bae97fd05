"""Lowering: a planned SpecGraph becomes a Program — loaded stages wired to an executor."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoTokenizer

from specgraph.draft import Drafter
from specgraph.errors import SpecgraphError
from specgraph.graph import SpecGraph
from specgraph.kernels import Kernels
from specgraph.models.loader import load_model
from specgraph.parallel import rank_and_world, shard_model
from specgraph.passes import run_pipeline
from specgraph.recipe import Recipe
from specgraph.runtime.serial import Generation, SerialExecutor, Verifier
from specgraph.runtime.stage import Stage


def plan(recipe: Recipe) -> SpecGraph:
    """Recipe -> graph -> every pass of PIPELINE."""
    return run_pipeline(SpecGraph.from_recipe(recipe))


def compile_model(model: nn.Module) -> None:
    """Compile, in place, each decoder layer and the work before and after them (`stem`: embedding
    and rotary tables; `logits`: final norm and head). Layers share code, so Inductor compiles it
    once per shape class (T = 1, and T symbolic) and every layer reuses it. Layers get their cache
    tensors, not an index, so that nothing layer-specific is a compile-time constant."""
    for layer in model.layers:
        layer.compile(dynamic=True, fullgraph=True)
    model.stem = torch.compile(model.stem, dynamic=True, fullgraph=True)
    model.logits = torch.compile(model.logits, dynamic=True, fullgraph=True)


def _load(name: str, node: dict, rank: int, world: int) -> nn.Module:
    """The stage's model on its device; a tensor-parallel stage's shard is cut on the host first."""
    if node["tp"] == 1:
        return load_model(node["model"].path, node["dtype"], node["device"])
    whole = load_model(node["model"].path, node["dtype"], "cpu")
    return shard_model(whole, rank, world, dist.group.WORLD, f"stage {name}").to(node["device"])


class Program:
    """Stages loaded from the plan (or given as `models`, by stage name) and the executor over them,
    lowered as the plan's `kernels`, `compile`, `static_shapes`, `graph_buckets` and `step_graphs` annotations say."""

    def __init__(self, graph: SpecGraph, models: dict[str, nn.Module] | None = None):
        self.graph = graph
        self.recipe = graph.recipe
        models = models or {}
        self.stages = {}
        rank, world = rank_and_world()
        kernels = {name: Kernels.select(graph.node(name)["kernels"]) for name in graph.stages()}
        for name in graph.stages():
            node = graph.node(name)
            if node["tp"] > 1 and node["tp"] != world:
                raise SpecgraphError(f"stage {name} is tensor-parallel over {node['tp']} devices, which needs one process "
                                     f"per device: `specgraph run` and `specgraph bench` start them (this process group "
                                     f"has {world})")
            model = models.get(name) or _load(name, node, rank, world)
            if hasattr(model, "use_kernels"):  # (an exported package has its ops built in)
                model.use_kernels(kernels[name])
            if node["compile"]:
                compile_model(model)
            stage = Stage(name, model, node["cache_slots"], node["device"], node["graph_buckets"], node["static_shapes"])
            stage.cache.move_rows = kernels[name].kv_move
            self.stages[name] = stage
        target = graph.node(graph.target)
        self.tokenizer = AutoTokenizer.from_pretrained(target["model"].path, trust_remote_code=False)
        self.verifier = Verifier(self.stages[graph.target], target["spec"].verify, target["rule"], self.recipe.sampling,
                                 kernels[graph.target], target["compile"])
        drafter = None
        if (draft_name := graph.drafter_of(graph.target)) is not None:
            drafter = Drafter(self.stages[draft_name], graph.node(draft_name)["tree"], target["rule"],
                              self.recipe.sampling)
        self.executor = SerialExecutor(self.verifier, drafter, target["eos_ids"], self.recipe.max_seq_len,
                                       target["step_graphs"], target["compile"])

    def autoregressive(self) -> SerialExecutor:
        """The target alone, one token per step, on the same loaded stage (the `ar` baseline), its
        steps captured wherever the target's forwards have static shapes."""
        target = self.graph.node(self.graph.target)
        return SerialExecutor(self.verifier, None, self.executor.eos_ids, self.recipe.max_seq_len,
                              target["static_shapes"], target["compile"])

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> Program:
        return cls(plan(recipe))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None, seed: int | None = None) -> Generation:
        if not 0 < len(prompt_ids) < self.recipe.max_seq_len:
            raise SpecgraphError(f"a prompt of {len(prompt_ids)} tokens does not fit: prompts need 1 to "
                                 f"{self.recipe.max_seq_len - 1} tokens (max_seq_len {self.recipe.max_seq_len})")
        return self.executor.generate(prompt_ids, max_new_tokens or self.recipe.max_new_tokens,
                                      self.recipe.sampling.seed if seed is None else seed)
