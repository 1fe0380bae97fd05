"""place: resolve each stage's device partition and dtype.

Before: stages carry `spec.devices` as written (cpu, cuda:N, auto).
After:  + `tp` (int): the stage's tensor-parallel degree, the length of its device list; every
          stage with more than one device must list the same number, one per process (rank);
        + `device` (torch.device): this process's device for the stage — entry `rank` of the list
          (rank 0's when planning outside a process group, as `inspect` does); a stage listing one
          device runs whole on that device in every process, so beside tensor-parallel stages it
          must be the CPU (one GPU shared by every rank's process would serialise them);
        + `dtype` (torch.dtype; `auto` = float32 on cpu, bfloat16 on cuda).
"""

from __future__ import annotations

import re

import torch

from specgraph.errors import RecipeError
from specgraph.graph import SpecGraph
from specgraph.models.loader import is_hybrid, resolve_dtype
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


@graph_pass(requires=("config",), provides=("tp", "device", "dtype"))
def place(graph: SpecGraph) -> SpecGraph:
    rank, _ = rank_and_world()
    degrees = {}
    for name in graph.stages():
        node = graph.node(name)
        spec, index = node["spec"], node["index"]
        devices = [resolve_device(d, f"stages.{index}.devices.{i}") for i, d in enumerate(spec.devices)]
        gpus = [d for d in devices if d.type == "cuda"]
        if len(set(gpus)) < len(gpus):
            raise RecipeError(f"stages.{index}.devices: a GPU is listed twice; give each tensor-parallel rank its own")
        if len(devices) > 1:
            if is_hybrid(node["config"]):
                raise RecipeError(f"stages.{index}.devices: models.{spec.model} is a hybrid model, which is not "
                                  "tensor-parallel yet; list one device")
            degrees[index] = len(devices)
        node["tp"] = len(devices)
        node["device"] = devices[rank] if len(devices) > 1 else devices[0]
        node["dtype"] = resolve_dtype(node["model"].dtype, node["device"])
    if len(set(degrees.values())) > 1:
        listed = ", ".join(f"stages.{i}: {n}" for i, n in degrees.items())
        raise RecipeError(f"stages.*.devices: tensor-parallel stages must list the same number of devices ({listed})")
    if degrees:
        world = next(iter(degrees.values()))
        for name in graph.stages():
            node = graph.node(name)
            if node["tp"] == 1 and node["device"].type == "cuda":
                raise RecipeError(f"stages.{node['index']}.devices: {node['device']} would be shared by the "
                                  f"{world} processes of the tensor-parallel stages; list {world} GPUs here too, or cpu")
    return graph
