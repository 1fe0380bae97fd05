"""A rank's share of a multi-process program: the stages it runs and its part in each system.

A system is something the program can decode with: `specgraph` (the recipe's executor), and for
`specgraph bench` the baselines `ar` (the target alone) and `serial` (the recipe on the serial
executor, every stage on the target's devices). Rank 0 drives: `generate` sends the request to
every rank over the control group, runs its own part and gathers every rank's statistics; the
other ranks `serve` requests until rank 0 shuts them down. Each rank's part of a system is an
executor over its own stages (the serial executor on every rank of a serial program; the target's
or the drafter's worker of a disaggregated one; nothing, for ranks a baseline does not use).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from specgraph.engine.engine import Engine
from specgraph.errors import SpecgraphError
from specgraph.graph import SpecGraph
from specgraph.lower import build_engine, build_executor, build_verifier, load_stage, stage_over, widened_models
from specgraph.passes import plan
from specgraph.runtime.executor import Executor, Generation
from specgraph.runtime.ranks import Ranks
from specgraph.text import Tokenizer
from specgraph.watchdog import PROGRESS

SYSTEMS = ("specgraph", "ar", "serial")


@dataclass(frozen=True)
class LaunchSpec:
    """What every rank builds its Worker from: the planned graph (planned once, by the client)."""

    graph: SpecGraph
    widen: str | None = None  # bench: the target's real shape (the drafter widens to the small one)
    systems: tuple[str, ...] = ("specgraph",)  # what the ranks can run: specgraph, ar, serial
REQUEST, SHUTDOWN = 0, 1


class Idle:
    """A rank's part in a system that does not use its stages."""

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        return Generation(output_ids=[])


class Worker:
    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.graph = spec.graph
        self.recipe = spec.graph.recipe
        self.ranks = Ranks.join(self.graph)
        mine = [name for name in self.graph.stages() if self.ranks.runs(name)]
        models = widened_models(self.graph, mine, spec.widen, self.ranks)
        self.stages = {name: load_stage(self.graph, name, models.get(name), self.ranks) for name in mine}
        target = self.graph.target
        self.device = self.graph.node(mine[0])["device"]
        self.roles: dict[str, Executor | Idle] = {"specgraph": build_executor(self.graph, self.stages, self.ranks)}
        if "ar" in spec.systems:
            self.roles["ar"] = self._autoregressive() if self.ranks.runs(target) else Idle()
        if "serial" in spec.systems and self.recipe.execution != "serial":
            self.roles["serial"] = self._serial() if self.ranks.runs(target) else Idle()
        self.tokenizer = Tokenizer(self.graph.node(target)["model"].path) if self.ranks.rank == 0 else None
        if self.ranks.control is not None:
            dist.barrier(group=self.ranks.control)  # every rank has loaded its stages

    def _autoregressive(self) -> Engine:
        """The target alone: the serial engine of a recipe of the target stage only, over its loaded model."""
        target = self.graph.target
        alone = self.recipe.stages[self.graph.node(target)["index"]]
        alone = alone.model_copy(update={"verifies": None, "verify": alone.verify.model_copy(
            update={"window": None, "budget": None})})
        graph = plan(self.recipe.model_copy(update={"execution": "serial", "stages": [alone]}))
        stages = {target: stage_over(graph, target, self.stages[target].model)}
        return build_engine(graph, build_verifier(graph, stages), None)

    def _serial(self) -> Executor:
        """The recipe on the serial executor with every stage on the target's devices: the target
        stage loaded here, and the drafter loaded again beside it (split the same way). A
        pipeline's serial recipe is its first stage drafting for its last."""
        target = self.graph.target
        devices = self.recipe.stages[self.graph.node(target)["index"]].devices
        first, last = self.recipe.stages[0], self.recipe.stages[-1]
        kept = [first.model_copy(update={"devices": devices, "grow": None}),
                last.model_copy(update={"devices": devices, "verifies": first.name,
                                        "verify": last.verify.model_copy(update={"window": None})})]
        recipe = self.recipe.model_copy(update={"execution": "serial", "stages": kept})
        graph = plan(recipe)
        group = self.ranks.groups[target]
        ranks = Ranks(self.ranks.rank, self.ranks.world, self.ranks.control, dict.fromkeys(graph.stages(), group),
                      dict.fromkeys(graph.stages(), self.ranks.stage_ranks[target]))
        drafters = [name for name in graph.stages() if name != target]
        models = widened_models(graph, drafters, self.spec.widen, ranks)
        stages = ({target: stage_over(graph, target, self.stages[target].model)}
                  | {n: load_stage(graph, n, models.get(n), ranks) for n in drafters})
        return build_executor(graph, stages, ranks)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def system(self, name: str) -> DrivenSystem:
        return DrivenSystem(self, name)

    def generate(self, system: str, prompt_ids: list[int], max_new_tokens: int, seed: int) -> Generation:
        """Rank 0: run `system` on every rank for one prompt -> the Generation, with every rank's statistics."""
        assert self.ranks.rank == 0
        if system not in self.roles:
            raise SpecgraphError(f"system {system!r} was not prepared in this program; prepared: {', '.join(self.roles)}")
        if self.ranks.control is not None:
            header = torch.tensor([REQUEST, SYSTEMS.index(system), len(prompt_ids), max_new_tokens, seed])
            dist.broadcast(header, 0, group=self.ranks.control)
            dist.broadcast(torch.tensor(prompt_ids), 0, group=self.ranks.control)
        return self._run(system, prompt_ids, max_new_tokens, seed)

    def serve(self) -> None:
        """Ranks other than 0: run each request rank 0 sends, until it shuts the program down."""
        while True:
            PROGRESS.idle()
            header = torch.zeros(5, dtype=torch.long)
            dist.broadcast(header, 0, group=self.ranks.control)
            op, system, length, max_new_tokens, seed = header.tolist()
            if op == SHUTDOWN:
                return
            prompt = torch.zeros(length, dtype=torch.long)
            dist.broadcast(prompt, 0, group=self.ranks.control)
            self._run(SYSTEMS[system], prompt.tolist(), max_new_tokens, seed)

    def _run(self, system: str, prompt_ids: list[int], max_new_tokens: int, seed: int) -> Generation:
        """This rank's part of one request, then the statistics of every rank gathered in rank 0's Generation."""
        generation = self.roles[system].generate(prompt_ids, max_new_tokens, seed)
        PROGRESS.idle()
        PROGRESS.first_request_done()
        if self.ranks.control is not None:
            gathered = [None] * self.ranks.world if self.ranks.rank == 0 else None
            dist.gather_object(generation.stats, gathered, dst=0, group=self.ranks.control)
            if gathered is not None:
                generation.stats = {key: value for stats in gathered for key, value in stats.items()}
                if "draft_hidden_seconds" in generation.stats:  # the drafter's work, hidden or not
                    generation.draft_seconds = (generation.stats["draft_hidden_seconds"]
                                                + generation.stats["draft_critical_seconds"])
        return generation

    def shutdown(self) -> None:
        if self.ranks.control is not None:
            dist.broadcast(torch.tensor([SHUTDOWN, 0, 0, 0, 0]), 0, group=self.ranks.control)


class DrivenSystem:
    """A system as rank 0 sees it: an Executor whose every call runs on all ranks."""

    def __init__(self, worker: Worker, name: str):
        self.worker, self.name = worker, name
        self.device = worker.device

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        return self.worker.generate(self.name, prompt_ids, max_new_tokens, seed)


def generate_on(worker: Worker, system: str, prompt_ids: list[int], max_new_tokens: int, seed: int) -> Generation:
    """What a client's `cluster.call` runs in rank 0 to decode one prompt."""
    return worker.generate(system, prompt_ids, max_new_tokens, seed)

