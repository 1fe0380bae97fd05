"""One process per tensor-parallel rank: `specgraph run` and `bench` start them when a recipe's
stages list several devices, join them in one process group (NCCL on GPUs, gloo on the CPU) and
run the same command in each; rank 0 prints and writes files, the others are silent."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specgraph.recipe import Recipe


def tensor_parallel_devices(recipe: Recipe) -> list[str]:
    """The device list of the recipe's tensor-parallel stages ([] when every stage has one device)."""
    return max((s.devices for s in recipe.stages if len(s.devices) > 1), key=len, default=[])


def is_reporter() -> bool:
    """Whether this process prints and writes results (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def launch(argv: list[str], devices: list[str]) -> int:
    """Run `specgraph argv` in one process per device; returns the exit status."""
    with socket.socket() as s:  # a free port for the process group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if any(d.startswith("cuda") for d in devices) else "gloo"
    print(f"specgraph: starting {len(devices)} processes, one per device ({', '.join(devices)}), over {backend}",
          file=sys.stderr)
    try:
        mp.spawn(_rank, args=(argv, devices, port, backend), nprocs=len(devices))
    except mp.ProcessExitedException as exc:
        return exc.exit_code
    except mp.ProcessRaisedException as exc:
        print(f"specgraph: error: rank {exc.error_index} failed:\n{exc}", file=sys.stderr)
        return 1
    return 0


def _rank(rank: int, argv: list[str], devices: list[str], port: int, backend: str) -> None:
    from specgraph.cli import main

    if rank > 0:  # rank 0 reports; the others run the same steps silently
        sys.stdout = sys.stderr = open(os.devnull, "w")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if devices[rank].startswith("cuda:"):
        torch.cuda.set_device(torch.device(devices[rank]))
    dist.init_process_group(backend, rank=rank, world_size=len(devices))
    try:
        status = main(argv)
    finally:
        dist.destroy_process_group()
    if status:
        sys.exit(status)
