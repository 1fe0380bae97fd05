"""place: resolve each stage's device partition and dtype.

Before: stages carry `spec.devices` as written (cpu, cuda:N, auto).
After:  + `tp` (int): the stage's tensor-parallel degree, the length of its device list;
        + `ranks` (tuple): the processes that run the stage. Serial execution runs every stage in
          every process, in lockstep: stages with several devices list the same number, and a
          stage listing one device runs whole in each process, so beside tensor-parallel stages it
          must be the CPU (one GPU shared by every rank's process would serialise them); a process
          runs all its stages on one device (the engine keeps a batch's tokens there).
          Disaggregated and pipeline execution give each stage processes of its own, the target's
          first (rank 0 leads the target); two stages may list the same GPU.
        + `device` (torch.device): this process's device for the stage — its entry of the list
          where this rank runs a split stage, else the first (as when planning outside a process
          group, as `inspect` does);
        + `dtype` (torch.dtype; `auto` = float32 on cpu, bfloat16 on cuda).
"""

from __future__ import annotations

import re

import torch

from specgraph.errors import RecipeError
from specgraph.graph import SpecGraph
from specgraph.models.loader import resolve_dtype
from specgraph.parallel import rank_and_world
from specgraph.passes.base import graph_pass


def present_devices() -> list[str]:
    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def resolve_device(name: str, where: str) -> torch.device:
    present = present_devices()
    if name == "auto":
        return torch.device(present[1] if len(present) > 1 else "cpu")
    if not re.fullmatch(r"cpu|cuda:\d+", name):
        raise RecipeError(f"{where}: {name!r} is not a device; valid: cpu, cuda:N, auto")
    if name not in present:
        raise RecipeError(f"{where}: device {name} is not present; this machine has: {', '.join(present)}")
    return torch.device(name)


@graph_pass(requires=("config",), provides=("tp", "ranks", "device", "dtype"))
def place(graph: SpecGraph) -> SpecGraph:
    rank, _ = rank_and_world()
    devices = {}
    for name in graph.stages():
        node = graph.node(name)
        spec, index = node["spec"], node["index"]
        devices[name] = [resolve_device(d, f"stages.{index}.devices.{i}") for i, d in enumerate(spec.devices)]
        gpus = [d for d in devices[name] if d.type == "cuda"]
        if len(set(gpus)) < len(gpus):
            raise RecipeError(f"stages.{index}.devices: a GPU is listed twice; give each tensor-parallel rank its own")
    ranks = _shared_ranks(graph, devices) if graph.recipe.execution == "serial" else _own_ranks(graph, devices)
    for name in graph.stages():
        node = graph.node(name)
        node["tp"] = len(devices[name])
        node["ranks"] = ranks[name]
        mine = rank in ranks[name] and node["tp"] > 1
        node["device"] = devices[name][ranks[name].index(rank)] if mine else devices[name][0]
        node["dtype"] = resolve_dtype(node["model"].dtype, node["device"])
    return graph


def _shared_ranks(graph: SpecGraph, devices: dict[str, list[torch.device]]) -> dict[str, tuple[int, ...]]:
    """Serial execution: every rank runs every stage in lockstep, so tensor-parallel stages list
    the same number of devices and one-device stages run whole in every process."""
    degrees = {graph.node(n)["index"]: len(d) for n, d in devices.items() if len(d) > 1}
    if len(set(degrees.values())) > 1:
        listed = ", ".join(f"stages.{i}: {n}" for i, n in degrees.items())
        raise RecipeError(f"stages.*.devices: tensor-parallel stages must list the same number of devices ({listed}); "
                          "with execution: disaggregated each stage has processes of its own")
    world = max(degrees.values(), default=1)
    for name, listed in devices.items():
        if world > 1 and len(listed) == 1 and listed[0].type == "cuda":
            raise RecipeError(f"stages.{graph.node(name)['index']}.devices: {listed[0]} would be shared by the "
                              f"{world} processes of the tensor-parallel stages; list their {world} devices here too")
    for rank in range(world):
        used = {f"stages.{graph.node(n)['index']}": d[rank if len(d) > 1 else 0] for n, d in devices.items()}
        if len(set(used.values())) > 1:
            where = ", ".join(f"{stage} on {device}" for stage, device in used.items())
            raise RecipeError(f"stages.*.devices: serial execution runs a process's stages on one device (the engine "
                              f"keeps its batch there), but process {rank} would run {where}; list the same devices "
                              "for every stage, or give each stage devices of its own with execution: disaggregated "
                              "(two stages) or pipeline")
    return {name: tuple(range(world)) for name in devices}


def _own_ranks(graph: SpecGraph, devices: dict[str, list[torch.device]]) -> dict[str, tuple[int, ...]]:
    """Asynchronous execution: each stage has processes of its own (ranks), the target's first, so
    that rank 0 is the target's leader; stages may share a GPU (as separate processes)."""
    ranks, first = {}, 0
    for name in reversed(graph.stages()):
        ranks[name] = tuple(range(first, first + len(devices[name])))
        first += len(devices[name])
    return ranks


def world_size(graph: SpecGraph) -> int:
    """The processes a planned graph runs in."""
    return 1 + max(max(graph.node(name)["ranks"]) for name in graph.stages())
