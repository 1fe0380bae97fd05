"""Programmatic dependent launch (Hopper and later GPUs).

A kernel launched with it may be scheduled while the kernel before it drains: it does what needs
no input of that kernel (address arithmetic, loading weights), then waits (`griddepcontrol.wait`,
which returns once the kernel before has completed and its writes are visible) before it reads
activations or writes anything. Our decode kernels also let their dependents launch as soon as all
their programs have started, so in a chain of them each kernel's launch and first weight loads
overlap the previous kernel's tail: CUDA-graph replays stop paying one launch-and-ramp per kernel.
Kernels take a `PDL` constexpr; with it False (the CPU interpreter, older GPUs) they are unchanged.
"""

from __future__ import annotations

import functools
import os

import torch

from specgraph.kernels import interpreted

ENABLED = os.environ.get("SPECGRAPH_PDL", "1") != "0"  # SPECGRAPH_PDL=0 launches plainly (for comparisons)


@functools.cache
def _supported(index: int) -> bool:
    return not interpreted() and torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch dependently."""
    return ENABLED and device.type == "cuda" and _supported(device.index or 0)


def launch(device: torch.device) -> dict:
    """The extra launch arguments of a kernel call on `device` (PDL=..., and launch_pdl where on)."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}
