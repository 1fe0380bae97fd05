"""place: resolve each stage's device partition and dtype.

Before: stages carry `spec.devices` as written (cpu, cuda:N, auto).
After:  + `device` (torch.device), `dtype` (torch.dtype; `auto` = float32 on cpu, bfloat16 on cuda).
"""

from __future__ import annotations

import re

import torch

from specgraph.errors import RecipeError
from specgraph.graph import SpecGraph
from specgraph.models.loader import resolve_dtype
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


@graph_pass(requires=("config",), provides=("device", "dtype"))
def place(graph: SpecGraph) -> SpecGraph:
    for name in graph.stages():
        node = graph.node(name)
        spec, index = node["spec"], node["index"]
        devices = [resolve_device(d, f"stages.{index}.devices.{i}") for i, d in enumerate(spec.devices)]
        if len(devices) > 1:
            raise RecipeError(f"stages.{index}.devices: tensor parallelism over {len(devices)} devices is not "
                              "implemented yet; give one device")
        node["device"] = devices[0]
        node["dtype"] = resolve_dtype(node["model"].dtype, devices[0])
    return graph
