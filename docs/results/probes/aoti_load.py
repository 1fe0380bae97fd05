# One-off probe, kept for the record: run 34 in docs/benchmarks.md (python3 docs/results/probes/aoti_load.py on the H200:
# a one-layer CUDA package, then the tree recipe's draft stage, each exported, compiled and loaded in a fresh process).
import subprocess, sys, torch
from torch.export import Dim
LOAD = "import torch,sys; r=torch._inductor.aoti_load_package(sys.argv[1]); print('loaded', flush=True)"
def load(path):
    p = subprocess.run([sys.executable, "-c", LOAD, path], capture_output=True, text=True)
    print(path, "load rc", p.returncode, p.stdout.strip(), p.stderr.strip()[-1500:], flush=True)
class Toy(torch.nn.Module):
    def __init__(s): super().__init__(); s.l = torch.nn.Linear(8, 8)
    def forward(s, x): return s.l(x)
ep = torch.export.export(Toy().cuda(), (torch.randn(2, 8, device="cuda"),))
torch._inductor.aoti_compile_and_package(ep, package_path="/tmp/toy.pt2")
load("/tmp/toy.pt2")
from specgraph.export import _StepModule
from specgraph.kernels import Kernels
from specgraph.program import Program
from specgraph.recipe import Recipe
prog = Program.from_recipe(Recipe.from_yaml("recipes/tree.yaml", ["max_seq_len=300", "lowering.compile=false"]))
stage = prog.stages["draft"]
stage.model.use_kernels(Kernels())
cache = stage.cache.tensors()
d = stage.device
t, kv = Dim("t", min=1, max=64), Dim("kv", min=1, max=stage.cache.capacity)
example = (torch.zeros(1, 2, dtype=torch.long, device=d), torch.arange(2, device=d)[None], torch.arange(2, device=d),
           torch.ones(2, 4, dtype=torch.bool, device=d), cache)
ep = torch.export.export(_StepModule(stage.model, type(stage.cache)), example,
                         dynamic_shapes=({1: t}, {1: t}, {0: t}, {0: t, 1: kv}, tuple(None for _ in cache)))
print("state devices", {str(v.device) for v in ep.state_dict.values()}, "constants",
      {k: (str(v.device), tuple(v.shape)) for k, v in ep.constants.items()}, flush=True)
print("cpu placeholders", [n.name for n in ep.graph.nodes if n.op == "placeholder" and "val" in n.meta
                           and hasattr(n.meta["val"], "device") and n.meta["val"].device.type == "cpu"], flush=True)
print("cpu nodes", [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and hasattr(n.meta.get("val"), "device")
                    and n.meta["val"].device.type == "cpu"][:20], flush=True)
torch._inductor.aoti_compile_and_package(ep, package_path="/tmp/draft.pt2")
load("/tmp/draft.pt2")
