"""Triton kernels as a GPU compiles them, checked on the CPU.

Triton's interpreter (TRITON_INTERPRET=1, how the CPU tests run our kernels) executes a kernel as
Python, so a kernel that Triton's compiler refuses — a variable given another shape inside an
`if`, say — passes every interpreted test and fails only on a GPU. Within `recording`, interpreted
launches append what the compiler needs (argument types, constexpr values) to a list (conftest.py
keeps the kernel tests' launches); run as `python tests/kernel_launches.py FILE` (without the
interpreter) this module compiles each launch recorded in FILE for a Hopper GPU (sm_90), dependent
launch on, and prints the kernels Triton refuses."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from contextlib import contextmanager

import torch

POINTEE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
           torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + POINTEE[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a kernel argument of type {type(value).__name__}")


@contextmanager
def recording(lines: list[str]):
    """Within it, every interpreted kernel launch appends one JSON line to `lines`."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
        constexprs = {n: v for n, v in bound.items()  # (a None argument: Triton makes it a constexpr)
                      if "constexpr" in str(params[n].annotation) or v is None}
        launch = {"module": self.fn.__module__, "kernel": self.fn.__name__, "constexprs": constexprs,
                  "signature": {n: _type(v) for n, v in bound.items() if n not in constexprs}}
        lines.append(json.dumps(launch, sort_keys=True))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = record
    try:
        yield
    finally:
        InterpretedFunction.run = run


def launched_kernels(package: str = "specgraph.kernels") -> set[tuple[str, str]]:
    """(module, kernel) of every @triton.jit function that its module launches (`name[grid](...)`)."""
    import pkgutil

    found = set()
    for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
        module = importlib.import_module(info.name)
        source = inspect.getsource(module)
        found |= {(info.name, name) for name, obj in vars(module).items()
                  if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and obj.fn.__module__ == info.name
                  and f"{name}[" in source}
    return found


def compile_one(line: str) -> str | None:
    """Compile one recorded launch for sm_90 -> None, or a line naming the kernel Triton refuses and why."""
    from triton import compile as compile_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launch = json.loads(line)
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    constexprs = launch["constexprs"] | ({"PDL": True} if "PDL" in launch["constexprs"] else {})
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else launch["signature"][n] for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    try:
        compile_kernel(source, target=GPUTarget("cuda", 90, 32))
    except Exception as error:  # noqa: BLE001 (the compiler's errors have no common type)
        return f"{launch['module']}.{launch['kernel']} {constexprs}: {str(error).splitlines()[0]}"
    return None


def compile_all(path: str) -> list[str]:
    """Compile every distinct recorded launch for sm_90, one process per usable core; returns one line per refused kernel."""
    from concurrent.futures import ProcessPoolExecutor

    launches = sorted(set(open(path).read().splitlines()))
    with ProcessPoolExecutor(min(len(os.sched_getaffinity(0)), len(launches))) as pool:
        results = pool.map(compile_one, launches)
    return [refused for refused in results if refused]


if __name__ == "__main__":
    failures = compile_all(sys.argv[1])
    print("\n".join(failures) or "every recorded launch compiles for sm_90")
    sys.exit(1 if failures else 0)
