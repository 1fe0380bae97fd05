"""A process's place in a multi-process program: its rank, and the process groups it talks over.

Every rank creates the same groups in the same order (torch.distributed requires it): `control`
(gloo, every rank: requests and statistics, CPU tensors) and one group per distinct set of stage
ranks (NCCL on GPUs, gloo on the CPU: a tensor-parallel stage's all-reduces and its leader's
broadcasts to the rest of the stage). Messages between stage leaders go point to point over the
default group (see runtime/channel.py), and a pipeline's over `mail` (gloo, every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from specgraph.graph import SpecGraph
from specgraph.passes.place import world_size


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    control: dist.ProcessGroup | None = None
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)  # stage -> its ranks' group
    stage_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    mail: dist.ProcessGroup | None = None  # gloo, every rank: a pipeline's messages between its stages

    @classmethod
    def join(cls, graph: SpecGraph) -> Ranks:
        """This process's ranks and groups, in an initialised default process group of the plan's size."""
        if not dist.is_initialized():
            assert world_size(graph) == 1, "a multi-process plan runs in a process group"
            return cls(stage_ranks={name: graph.node(name)["ranks"] for name in graph.stages()})
        assert dist.get_world_size() == world_size(graph), "the process group is not the plan's"
        control = dist.new_group(backend="gloo")
        made: dict[tuple, dist.ProcessGroup] = {}
        groups = {}
        for name in graph.stages():
            node = graph.node(name)
            key = (node["ranks"], "nccl" if node["device"].type == "cuda" else "gloo")
            if key not in made:
                made[key] = dist.new_group(list(key[0]), backend=key[1])
            groups[name] = made[key]
        mail = dist.new_group(backend="gloo") if graph.recipe.execution == "pipeline" else None
        return cls(dist.get_rank(), dist.get_world_size(), control, groups,
                   {name: graph.node(name)["ranks"] for name in graph.stages()}, mail)

    def slowest(self, stage: str, device: torch.device) -> Callable[[tuple[float, ...]], tuple[float, ...]]:
        """Times measured on each rank of `stage` (on `device`) -> each time the largest over them, the
        same on every rank: decisions taken on times (a step's mode) then agree, where one rank's clock
        alone would part them."""
        if not self.split(stage):
            return lambda seconds: seconds

        def agree(seconds: tuple[float, ...]) -> tuple[float, ...]:
            values = torch.tensor(seconds, dtype=torch.float64, device=device)
            dist.all_reduce(values, dist.ReduceOp.MAX, group=self.groups[stage])
            return tuple(values.tolist())
        return agree

    def split(self, stage: str) -> bool:
        """Whether `stage` runs on several ranks."""
        return len(self.stage_ranks.get(stage, ())) > 1

    def runs(self, stage: str) -> bool:
        return self.rank in self.stage_ranks[stage]

    def leader(self, stage: str) -> int:
        return self.stage_ranks[stage][0]

    def shard(self, stage: str, tp: int) -> tuple[int, int, dist.ProcessGroup] | None:
        """(rank within the stage, degree, group) where this process holds a shard of a split stage."""
        if tp == 1:
            return None
        return self.stage_ranks[stage].index(self.rank), tp, self.groups[stage]
