"""Where AOTInductor's loading of a CUDA package crashes (issue 58, step 1; tests/test_gpu.py's
test_exported_program_on_gpu_gives_the_eager_tokens skips on the device's torch 2.11+cu130 because a fresh
process that loads even a one-layer package dies, run 34).

    python3 scripts/aoti_repro.py [--device cuda|cpu] [--seconds N] [--no-program]

Compiles tiny packages (an nn.Linear: one extern matmul, no Triton kernel; a pointwise chain: one Triton
kernel, none extern), then loads each in fresh processes in several ways (each under faulthandler, its exit
status printed; a crash is rc -11): as the test does, after CUDA is initialised, after a CUDA tensor exists,
single-threaded, only dlopen'ing the package's .so, in the compiling process; the crashing one again under gdb
for the native stack when gdb is there. Then, if some way loads, `specgraph compile`'s export of the chain
test's program and `run --program` in a fresh process with that way applied first, against the eager tokens.
Every line it prints is a finding; the CPU path is its rehearsal."""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
T0 = time.time()


def say(*args):
    print(f"[{time.time() - T0:6.1f}s]", *args, flush=True)


# How a fresh process loads the package: (name, code run before the load, the load expression)
LOADERS = {
    "plain": ("", "torch._inductor.aoti_load_package(P)"),  # what the test and ExportedModel do
    "cuda-init": ("torch.cuda.init(); torch.cuda.set_device(0)", "torch._inductor.aoti_load_package(P)"),
    "cuda-tensor": ("torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()",
                    "torch._inductor.aoti_load_package(P)"),
    "single-thread": ("import torch._inductor.package",
                      "torch._inductor.package.load_package(P, run_single_threaded=True)"),
    "torch-lib-path": ("", "torch._inductor.aoti_load_package(P)"),  # LD_LIBRARY_PATH: torch's and its nvidia libs first
    "import-inductor": ("import torch._inductor.codecache, torch._inductor.package",
                        "torch._inductor.aoti_load_package(P)"),
}
CHILD = """
import faulthandler, sys, time; faulthandler.enable()
import torch
P = sys.argv[1]
{before}
t = time.time(); runner = {load}; print('LOADED in %.2f s' % (time.time() - t), flush=True)
x = torch.randn(2, 8, device=sys.argv[2])
out = runner(x) if sys.argv[3] == 'call' else runner(x)
torch.cuda.synchronize() if sys.argv[2] == 'cuda' else None
print('RAN', tuple(out[0].shape if isinstance(out, (list, tuple)) else out.shape), flush=True)
"""


def child(code: str, *args, timeout=120, env=None, prefix=()) -> tuple[int, str]:
    cmd = [*prefix, sys.executable, "-c", code, *args]
    env = {**(env or os.environ), "TORCH_SHOW_CPP_STACKTRACES": "1"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    text = (p.stdout + p.stderr).strip()
    return p.returncode, text


def tail(text: str, lines=22) -> str:
    kept = [line[:300] for line in text.splitlines() if "UserWarning" not in line and "warnings.warn" not in line
            and not line.startswith("Extension modules")]
    return "\n      ".join(kept[-lines:])


class Linear(__import__("torch").nn.Module):
    def __init__(self):
        import torch
        super().__init__()
        self.l = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.l(x)


class MatMul(__import__("torch").nn.Module):
    """x @ w alone: one extern matmul, no Triton kernel at all (Linear's bias add becomes one, a .cubin)."""

    def __init__(self):
        import torch
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.w


class Pointwise(__import__("torch").nn.Module):
    def forward(self, x):
        return (x * 2 + 1).sin() * x.cos()


def compile_package(model, device, path, options=None):
    import torch
    model = model.to(device)
    x = torch.randn(2, 8, device=device)
    t = time.time()
    exported = torch.export.export(model, (x,))
    torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=options or {})
    say(f"compiled {path.name} in {time.time() - t:.1f} s (options {options or {}})")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
    say("  package files:", ", ".join(n.split("/", 2)[-1] for n in names if not n.endswith("/"))[:600])
    return model, x


def so_of(package: Path, into: Path) -> Path | None:
    with zipfile.ZipFile(package) as z:
        sos = [n for n in z.namelist() if n.endswith(".so")]
        if not sos:
            return None
        z.extract(sos[0], into)
        return into / sos[0]


def probe_package(path: Path, device: str, model, x, gdb: str | None) -> list[str]:
    """Each loader in a fresh process -> the names that loaded and ran."""
    import torch
    worked = []
    so = so_of(path, Path(tempfile.mkdtemp()))
    if so is not None:
        rc, text = child("import torch, ctypes, sys; ctypes.CDLL(sys.argv[1]); print('DLOPEN ok')", str(so))
        say(f"  dlopen of {so.name} after import torch: rc {rc} {tail(text, 4)}")
        ldd = subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
        say("  ldd: " + " | ".join(line.strip() for line in ldd.splitlines()))
        site = Path(torch.__file__).parent
        lib = [str(site / "lib"), *map(str, sorted(site.parent.glob("nvidia/**/lib")))]
        ldd = subprocess.run(["ldd", str(so)], capture_output=True, text=True,
                             env={**os.environ, "LD_LIBRARY_PATH": ":".join(lib)}).stdout
        say("  ldd with torch's lib dirs: " + " | ".join(line.strip() for line in ldd.splitlines()
                                                          if "cuda" in line or "torch" in line or "not found" in line))
    for name, (before, load) in LOADERS.items():
        if device != "cuda" and name in ("cuda-init", "cuda-tensor"):
            continue
        t = time.time()
        env = None
        if name == "torch-lib-path":
            site = Path(torch.__file__).parent.parent
            dirs = [str(Path(torch.__file__).parent / "lib"), *map(str, sorted(site.glob("nvidia/*/lib"))),
                    *map(str, sorted(site.glob("nvidia/cu*/lib")))]
            env = {**os.environ, "LD_LIBRARY_PATH": ":".join(dirs + [os.environ.get("LD_LIBRARY_PATH", "")])}
        rc, text = child(CHILD.format(before=before, load=load), str(path), device, "call", env=env)
        ok = rc == 0 and "RAN" in text
        say(f"  load {name:16s} rc {rc} ({time.time() - t:.1f} s) {'OK' if ok else 'FAILED'}")
        if not ok:
            say("      " + tail(text))
        else:
            worked.append(name)
        if name == "plain" and not ok and gdb:  # the native stack of the crash, first: it says the most
            code = CHILD.format(before="", load=LOADERS["plain"][1])
            rc, text = child(code, str(path), device, "call", timeout=150,
                             prefix=(gdb, "-batch", "-q", "-ex", "run", "-ex", "bt 30", "-ex", "info sharedlibrary libcuda",
                                     "--args"))
            frames = [line for line in text.splitlines() if line.startswith("#") or "signal" in line.lower()
                      or "libcuda" in line]
            say("  gdb, plain load:\n      " + "\n      ".join(f[:220] for f in frames[:45]))
    try:  # in the compiling process (CUDA initialised, inductor imported)
        runner = torch._inductor.aoti_load_package(str(path))
        out = runner(x)
        out = out[0] if isinstance(out, (list, tuple)) else out
        same = torch.allclose(out, model(x), atol=1e-4, rtol=1e-4)
        say(f"  load in the compiling process: OK, output {'equals' if same else 'DIFFERS FROM'} eager")
    except Exception as e:  # noqa: BLE001 (a finding, not a failure of this script)
        say(f"  load in the compiling process: {type(e).__name__}: {str(e)[:300]}")
    return worked


def program_check(device: str, before: str):
    """The chain test's program exported and run with --program in a fresh process (`before` run first), against
    the eager tokens; the times of export, load+run and the recipe's run."""
    import json

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import EMBEDDED
    from helpers import two_stage

    from specgraph.export import export_program
    from specgraph.program import Program

    prompt = "import os\nimport sys\n\n\ndef main(argv):\n"

    def build(**lowering):
        recipe = two_stage(EMBEDDED / "target", EMBEDDED / "draft", {"shape": "chain", "length": 4},
                           max_new_tokens=32, max_seq_len=300, lowering=lowering)
        recipe = recipe.model_copy(update={"stages": [s.model_copy(update={"devices": [f"{device}:0" if device == "cuda"
                                                                                         else "cpu"]})
                                                      for s in recipe.stages]})
        return Program.from_recipe(recipe)

    out = Path(tempfile.mkdtemp()) / "program"
    t = time.time()
    export_program(build(compile=False), out)
    say(f"program: exported and compiled in {time.time() - t:.1f} s")
    result = out.parent / "out.json"
    run = (f"import sys, runpy, torch; {before}; sys.argv = ['specgraph'] + sys.argv[1:]; "
           "runpy.run_module('specgraph.cli', run_name='__main__')")
    t = time.time()
    rc, text = child(run, "run", "--program", str(out), "--prompt", prompt, "--max-new-tokens", "32", "--json",
                     str(result), timeout=300)
    say(f"program: run --program rc {rc} in {time.time() - t:.1f} s (process start, load, decode)")
    if rc != 0:
        say("      " + tail(text, 20))
        return
    got = json.loads(result.read_text())
    eager = build(compile=False, kernels="reference")
    expected = eager.generate(eager.encode(prompt)).output_ids
    row = got["results"][0]
    say(f"program: tokens {'EQUAL the eager tokens' if row['output_ids'] == expected else 'DIFFER from the eager tokens'}"
        f"; summary {json.dumps({k: v for k, v in got.items() if k != 'results'})[:600]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=240)
    ap.add_argument("--no-program", action="store_true")
    ap.add_argument("--cases", default="matmul,linear,pointwise,linear-embed-cubin",
                    help="which packages, in order (a package takes ~80 s to compile on the H200)")
    args = ap.parse_args()
    import torch
    say("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0],
        torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu")
    cc = shutil.which("g++") or shutil.which("c++")
    cc_version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0] if cc else "none"
    say("compiler", cc, cc_version, "| gdb", shutil.which("gdb"), "| nvcc", shutil.which("nvcc"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        release = [l for l in subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.splitlines()
                   if "release" in l]
        say("nvcc:", release[:1], "| CUDA_HOME", os.environ.get("CUDA_HOME"), "| torch's cuda_home",
            getattr(__import__("torch.utils.cpp_extension", fromlist=["CUDA_HOME"]), "CUDA_HOME", None))
    gdb = shutil.which("gdb")
    folder = Path(tempfile.mkdtemp())
    worked = {}
    cases = [("matmul", MatMul(), None), ("linear", Linear(), None), ("pointwise", Pointwise(), None)]
    if args.device == "cuda":
        cases.append(("linear-embed-cubin", Linear(), {"aot_inductor.embed_kernel_binary": True}))
    wanted = args.cases.split(",")
    cases = sorted((c for c in cases if c[0] in wanted), key=lambda c: wanted.index(c[0]))
    for name, model, options in cases:
        if time.time() - T0 > args.seconds * 0.6:
            say(f"{name}: skipped (time)")
            continue
        path = folder / f"{name}.pt2"
        try:
            model, x = compile_package(model, args.device, path, options)
        except Exception as e:  # noqa: BLE001
            say(f"{name}: compile failed: {type(e).__name__}: {str(e)[:400]}")
            continue
        worked[name] = probe_package(path, args.device, model, x, gdb if name in ("matmul", "linear") else None)
        say(f"{name}: loaders that loaded and ran: {worked[name] or 'none'}")
    usable = [w for w in LOADERS if all(w in v for v in worked.values())] if worked else []
    say("loaders that worked for every package:", usable or "none")
    if args.no_program or not usable:
        return
    if time.time() - T0 > args.seconds - 90:
        say("program check: skipped (time)")
        return
    program_check(args.device, LOADERS[usable[0]][0] or "pass")


if __name__ == "__main__":
    main()
