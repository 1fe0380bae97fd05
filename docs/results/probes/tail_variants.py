# One-off probe, kept for the record: run 24 in docs/benchmarks.md (python3 docs/results/probes/tail_variants.py, from the
# repository root, with .fixtures/, and .scratch/attention_old.py = specgraph/kernels/attention/triton.py of commit 9ed308c with
# its op renamed probe::attention_old). It ran on commit f91c802's code plus a step-attention variant (prefetching key/value
# tiles: 'new') since dropped; 'tail' = the compiled regions around the layers of f91c802.
"""Autoregressive ms per token at the Llama-3-8B shape, each variant a fresh program: the work around the layers
compiled or not, the step attention before/after prefetching, qkv through the one-token projection."""
import gc, json, sys, time, importlib.util
import torch
import specgraph.program as prog
import specgraph.models.llama as llama
import specgraph.kernels.attention.triton as at
from specgraph.runtime import serial
from specgraph.recipe import Recipe
from specgraph.bench.harness import BenchSpec, build_systems, measure_copy_bandwidth
from specgraph.models.llama import qkv_sizes

spec = importlib.util.spec_from_file_location("attention_old", ".scratch/attention_old.py")
old_attention = importlib.util.module_from_spec(spec); spec.loader.exec_module(old_attention)
new_attention = at.attention
compile_model = prog.compile_model
def layers_only(model):
    for layer in model.layers:
        layer.compile(dynamic=True, fullgraph=True)
forward = llama.Attention.forward
def forward_gemv_qkv(self, x, cos, sin, keys, values, slots, mask):
    b, t, _ = x.shape
    qkv = self.kernels.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
    q, k, v = qkv.split(qkv_sizes(self.num_heads, self.num_kv_heads, self.head_dim), dim=-1)
    q = q.view(b, t, self.num_heads, self.head_dim); k = k.view(b, t, self.num_kv_heads, self.head_dim)
    v = v.view(b, t, self.num_kv_heads, self.head_dim)
    q = self.kernels.rope_write(q, k, v, cos, sin, keys, values, slots)
    out = self.kernels.attention(q, keys, values, mask, slots).transpose(1, 2).reshape(b, t, -1)
    return self.reduce(self.kernels.linear(out, self.o_proj.weight, self.o_proj.bias))

def configure(tail, attention, qkv_gemv):
    prog.compile_model = compile_model if tail else layers_only
    prog.Verifier = serial.Verifier if tail else (lambda *a: serial.Verifier(*a[:5], False))
    prog.SerialExecutor = serial.SerialExecutor if tail else (lambda *a: serial.SerialExecutor(*a[:5], False))
    at.attention = new_attention if attention == "new" else old_attention.attention
    llama.Attention.forward = forward_gemv_qkv if qkv_gemv else forward

variants = {"A tail off, attention old": (False, "old", False), "B tail on, attention old": (True, "old", False),
            "C tail on, attention new": (True, "new", False), "D tail on, attention new, qkv gemv": (True, "new", True),
            "A2 tail off, attention old": (False, "old", False), "C2 tail on, attention new": (True, "new", False)}
prompts = [json.loads(l) for l in open(".fixtures/prompts_code.jsonl")][:2]
results = {}
for name, config in variants.items():
    configure(*config)
    t0 = time.time()
    program, _, _ = build_systems(BenchSpec(Recipe.from_yaml("recipes/tree.yaml"), prompts, 128, 1, ("ar",), "llama-3-8b"))
    ar = program.autoregressive()
    ids = [program.encode(p["prompt"]) for p in prompts]
    outs = [ar.generate(i, 128).output_ids for i in ids]
    ms = []
    for _ in range(2):
        for i, o in zip(ids, outs):
            g = ar.generate(i, 128)
            assert g.output_ids == o
            ms.append((g.seconds - g.first_token_seconds) / (len(g.output_ids) - 1) * 1e3)
    results[name] = {"ms": ms, "tokens": outs}
    print(f"{name}: ar {sorted(ms)[2]:.3f} ms/token {['%.3f' % m for m in ms]} ({time.time()-t0:.0f}s)", flush=True)
    del program, ar
    gc.collect(); torch.cuda.empty_cache()
same = {n: r["tokens"] == results["A tail off, attention old"]["tokens"] for n, r in results.items()}
print("same tokens as A:", same)
print(f"copy bandwidth {measure_copy_bandwidth(torch.device('cuda'))/1e12:.3f} TB/s")
