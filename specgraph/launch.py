"""The processes of a multi-process program: one per rank, each running only its stages.

Launch is a function: `Cluster(spec)` starts the ranks and talks to rank 0 through a pipe;
`cluster.call(fn, *args)` runs `fn(worker, *args)` in rank 0, where `worker` is that rank's
`Worker` (worker.py), which drives the other ranks over torch.distributed. Ranks start
with the `forkserver` method: they fork from a server process that imported specgraph, torch and
transformers once, so a program's processes start in about a second, not an import each. A rank
takes the client's environment as it is when the rank starts (what modules read as they are
imported was read when the server started: the client's first multi-process program). Under
`torchrun` the same ranks are the processes torchrun started (`join_torchrun`): rank 0 is the
calling process itself and the others serve until it closes.

Faults end the run. The client watches every rank: one that raises or dies stops all of them
and `call` raises a one-line SpecgraphError naming the stage and rank. Each rank has a watchdog
thread that stops it when its main thread has waited on another stage, or been in one step, for
longer than the recipe's `timeout` (ten times that during the first request, where compilation
and CUDA-graph capture happen), and when the client that started it is gone. Ranks ignore
Ctrl-C; the client stops them all. The fork server and the ranks it forks are born with SIGINT
blocked (the terminal's Ctrl-C reaches its whole process group, and the server's import of its
modules takes seconds); a client interrupted while its program starts stops the server too, if it
started it.
"""

from __future__ import annotations

import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specgraph.errors import SpecgraphError
from specgraph.stack import on_a_stack_chunk_of_its_own
from specgraph.watchdog import PROGRESS
from specgraph.worker import LaunchSpec, Worker

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FORK_SERVER = multiprocessing.forkserver._forkserver  # multiprocessing's; its pid and _stop are not public


def rank_names(graph) -> list[str]:
    """'stage NAME rank R' for every rank of a planned graph (a rank of a serial program runs every stage)."""
    from specgraph.passes.place import world_size

    names = [""] * world_size(graph)
    for name in graph.stages():
        for r in graph.node(name)["ranks"]:
            names[r] = f"stage {name} rank {r}" if not names[r] else f"rank {r}"
    return names


def rank_devices(graph) -> list[str]:
    """Each rank's device: its entry of its stage's device list (a GPU where any of its stages has one)."""
    from specgraph.passes.place import resolve_device, world_size

    devices = ["cpu"] * world_size(graph)
    for name in graph.stages():
        node = graph.node(name)
        listed = [resolve_device(d, "") for d in node["spec"].devices]
        for i, r in enumerate(node["ranks"]):
            device = listed[i] if len(listed) > 1 else listed[0]
            if device.type == "cuda":
                devices[r] = str(device)
    return devices


def _watchdog(name: str, report: Callable[[str], None],
              client: multiprocessing.connection.Connection | None) -> None:
    """`client`: the read end of a pipe that only the client can write to and never does, so it
    reads end-of-file once the client is gone (None under torchrun)."""
    while True:
        time.sleep(0.25)
        if client is not None and client.poll():
            os._exit(1)  # the client is gone: nothing would read our results
        overdue = PROGRESS.overdue()
        if overdue is not None:
            report(f"{name}: {overdue}")
            os._exit(3)


def one_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return text if isinstance(exc, SpecgraphError) else f"{type(exc).__name__}: {text}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, device: str, spec: LaunchSpec):
    """Join the process group and build this rank's Worker."""
    for key, value in MULTICAST_OFF.items():
        os.environ.setdefault(key, value)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:  # ranks sharing the CPU: split its cores rather than each taking them all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and device.startswith("cuda") else "gloo"
    # no collective timeout of ours: the watchdog and the client bound every wait
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(days=1))
    PROGRESS.timeout = spec.graph.recipe.timeout
    return Worker(spec)


def _rank_main(rank: int, world: int, devices: list[str], names: list[str], port: int, spec: LaunchSpec,
               conn, errors, client: multiprocessing.connection.Connection, environment: dict[str, str]) -> None:
    """A started rank: serve until rank 0 is told to close; report a failure as one line and exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the client handles Ctrl-C and stops us
    report = lambda message: errors.put((rank, message))  # noqa: E731
    threading.Thread(target=_watchdog, args=(names[rank], report, client), daemon=True).start()
    os.environ.clear()  # the client's, not the fork server's (which has the client's from when it started)
    os.environ.update(environment, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    status = 0
    try:
        worker = _init(rank, world, devices[rank], spec)
        on_a_stack_chunk_of_its_own(lambda: _serve_client(worker, conn) if rank == 0 else worker.serve())
    except BaseException as exc:  # noqa: BLE001 - every failure ends the run, reported as one line
        if os.environ.get("SPECGRAPH_DEBUG"):
            traceback.print_exc()
        report(one_line(exc) if isinstance(exc, SpecgraphError) else f"{names[rank]}: {one_line(exc)}")
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no teardown: a peer may be gone, and NCCL's would wait for it


def _serve_client(worker, conn) -> None:
    conn.send(("ready", None))
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:  # the client is gone
            return
        if fn is None:
            worker.shutdown()
            conn.send(("closed", None))
            return
        try:
            conn.send(("ok", fn(worker, *args)))
        except SpecgraphError as exc:  # a user mistake found in rank 0 before any rank started on it
            conn.send(("error", str(exc)))


def _start_ranks(processes: list[multiprocessing.Process]) -> None:
    """Start the fork server unless it is running, then the ranks, with Ctrl-C held meanwhile (then
    raised: not lost). SIGINT is blocked in this thread: the server inherits the mask and keeps it, and
    so do the ranks it forks (its own main ignores SIGINT only after it has imported its preload, so a
    Ctrl-C during that import would print its traceback). Where another thread of this process takes
    the signal, it is recorded, not raised (in the main thread): a Ctrl-C between a rank's fork and its
    pid's return would leave a rank that `stop` does not know, which fails to read its arguments once
    this process has gone (a traceback)."""
    multiprocessing.resource_tracker.ensure_running()  # (its start, also part of the server's, unblocks SIGINT)
    pressed = []
    main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, lambda *_: pressed.append(True)) if main else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
        for process in processes:
            process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # (a Ctrl-C held by the mask is handled here)
        if main:
            signal.signal(signal.SIGINT, handler)
    if pressed:
        raise KeyboardInterrupt


class Cluster:
    """The client's handle on the ranks of a multi-process program (see the module docstring)."""

    def __init__(self, spec: LaunchSpec):
        graph = spec.graph
        self.names, devices = rank_names(graph), rank_devices(graph)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["specgraph.program", "specgraph.worker"])  # (once: before it starts)
        self._conn, theirs = ctx.Pipe()
        client, self._alive = ctx.Pipe(duplex=False)  # (see _watchdog: the write end stays here)
        self._errors = ctx.SimpleQueue()
        port = _free_port()
        print(f"specgraph: starting {len(self.names)} processes: "
              + ", ".join(f"{n} on {d}" for n, d in zip(self.names, devices)), file=sys.stderr)
        self.processes = [ctx.Process(target=_rank_main, name=self.names[r],
                                      args=(r, len(self.names), devices, self.names, port, spec, theirs if r == 0 else None,
                                            self._errors, client, dict(os.environ)))
                          for r in range(len(self.names))]
        self._closed = False
        server = FORK_SERVER._forkserver_pid  # None until a first program starts the server
        try:
            _start_ranks(self.processes)
            theirs.close()  # rank 0 holds it now: if rank 0 dies, our end reads end-of-file
            client.close()  # the ranks hold it
            self._reply()  # rank 0 is ready once every rank has loaded its stages
        except SpecgraphError as exc:
            self.stop()
            if "exited with status" not in str(exc):
                raise
            raise SpecgraphError(f"{exc} while starting (a Python script that loads a multi-process program "
                                 "needs its code under `if __name__ == '__main__':`, as the processes import it)") from None
        except BaseException:
            self.stop()
            if FORK_SERVER._forkserver_pid not in (None, server):
                # we started it: it may still be importing its preload, with our fork request
                # queued, and would fork a rank after we are gone before it noticed
                os.kill(FORK_SERVER._forkserver_pid, signal.SIGKILL)
                FORK_SERVER._stop()  # reaps it: the next program starts another
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def call(self, fn: Callable, *args):
        """fn(worker, *args) in rank 0 (fn a module-level function) -> its result."""
        if self._closed:
            raise SpecgraphError("this program's processes were stopped; load it again")
        try:
            self._conn.send((fn, args))
            return self._reply()
        except BaseException:
            self.stop()
            raise

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._conn.send((None, None))
            self._reply()
            for process in self.processes:
                process.join(timeout=30)
        finally:
            self.stop()

    def _reply(self):
        sentinels = {p.sentinel: r for r, p in enumerate(self.processes)}
        self._conn_dead = False
        while True:
            waiting_on = ([] if self._conn_dead else [self._conn]) + list(sentinels)
            ready = multiprocessing.connection.wait(waiting_on, timeout=1.0)
            if self._conn in ready:
                try:
                    kind, value = self._conn.recv()
                except (EOFError, OSError):  # rank 0 died (maybe mid-message): its sentinel says so
                    self._conn_dead = True
                    continue
                if kind == "error":
                    raise SpecgraphError(value)
                return value
            dead = [sentinels[s] for s in ready if s in sentinels]
            if dead:
                raise SpecgraphError(self._failure(dead[0]))

    def _failure(self, rank: int) -> str:
        """The one line that explains why rank `rank` ended: a rank killed by a signal (the others'
        errors follow from it), else the first report of a rank, else its exit status."""
        deadline = time.monotonic() + 2.0
        reports = []
        while time.monotonic() < deadline and not reports:
            while not self._errors.empty():
                reports.append(self._errors.get())
            time.sleep(0.05)
        killed = [r for r, p in enumerate(self.processes) if p.exitcode is not None and p.exitcode < 0]
        if killed:
            code = self.processes[killed[0]].exitcode
            return f"{self.names[killed[0]]} was killed by signal {-code} ({signal.Signals(-code).name})"
        own = [m for r, m in reports if r == rank]
        if own or reports:
            return (own or [reports[0][1]])[0]
        return f"{self.names[rank]} exited with status {self.processes[rank].exitcode}"

    def stop(self) -> None:
        """Stop every rank (terminate, then kill what is left) and wait for them: none outlives the run.
        Another thread's `call` in progress then fails, naming the rank."""
        self._closed = True
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + 5
        for process in self.processes:
            if process.pid is not None:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self._alive.close()  # (any rank still there: its watchdog ends it)

    def __del__(self):
        if not getattr(self, "_closed", True):
            self.stop()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


class InProcessCluster:
    """Rank 0 of a torchrun launch: `call` runs in this process; the other ranks serve until `close`."""

    def __init__(self, worker):
        self.worker = worker
        self.pids = [os.getpid()]

    def call(self, fn: Callable, *args):
        return fn(self.worker, *args)

    def close(self) -> None:
        self.worker.shutdown()

    stop = close  # (torchrun's ranks end only through the collective shutdown, after the call in progress)


def join_torchrun(spec: LaunchSpec) -> InProcessCluster:
    """Under torchrun: build this rank's Worker; rank 0 gets the cluster handle, the others serve
    and exit when rank 0 closes (they never return)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank > 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

    def report(message: str) -> None:
        print(f"specgraph: error: {message}", file=sys.stderr, flush=True)

    names = rank_names(spec.graph)
    if len(names) != world:
        raise SpecgraphError(f"torchrun started {world} processes; this recipe runs in {len(names)} "
                             f"({', '.join(names)}): pass --nproc-per-node {len(names)}")
    device = rank_devices(spec.graph)[rank]
    threading.Thread(target=_watchdog, args=(names[rank], report, None), daemon=True).start()
    try:
        worker = _init(rank, world, device, spec)
        if rank == 0:
            return InProcessCluster(worker)
        worker.serve()
    except BaseException as exc:  # noqa: BLE001
        report(one_line(exc) if isinstance(exc, SpecgraphError) else f"{names[rank]}: {one_line(exc)}")
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
