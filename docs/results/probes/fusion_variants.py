# One-off probe, kept for the record: run 30 in docs/benchmarks.md (python3 docs/results/probes/fusion_variants.py NAME
# ATTENTION_FILE MIN_CHUNK MLP, one process per variant; ATTENTION_FILE a copy of specgraph/kernels/attention/triton.py;
# MLP: "plain" (gate_up on cuBLAS, swiglu, down on our one-token projection), "down" (SwiGLU read by the down
# projection: no swiglu kernel) or "gate" (gate_up on a one-token projection whose programs take a gate row and its up
# row and store silu(gate) * up: no swiglu kernel)).
"""One variant per process: autoregressive ms per token at the Llama-3-8B shape."""
import importlib.util, json, sys
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import specgraph.kernels.attention.triton as at
from specgraph.kernels.pdl import launch
from specgraph.kernels.swiglu.triton import swiglu
from specgraph.models import llama
from specgraph.recipe import Recipe
from specgraph.bench.harness import BenchSpec, build_systems, measure_copy_bandwidth

name, path, min_chunk, mlp = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
source = open(path).read().replace('"specgraph::attention"', '"probe::attention"')
variant = importlib.util.module_from_spec(importlib.util.spec_from_file_location("variant", path))
exec(compile(source, path, "exec"), variant.__dict__)
variant.MIN_CHUNK = min_chunk
at.attention = variant.attention


@triton.jit
def _swiglu_gemv(gu, w, out, N, K, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[n] = w[n] . (silu(gate) * up), gu = [gate, up], rounded like swiglu then linear."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    acc = tl.zeros([BLOCK_K], tl.float32)
    b_w = tl.load(w + row * K + tl.arange(0, BLOCK_K), mask=tl.arange(0, BLOCK_K) < K, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = cols < K
        if k0 > 0:
            b_w = tl.load(w + row * K + cols, mask=m, other=0.0)
        g = tl.load(gu + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gu + K + cols, mask=m, other=0.0).to(tl.float32)
        silu = (g * tl.sigmoid(g)).to(out.dtype.element_ty).to(tl.float32)
        x = (silu * u).to(out.dtype.element_ty).to(tl.float32)
        acc += b_w.to(tl.float32) * x
    tl.store(out + row, tl.sum(acc, axis=0).to(out.dtype.element_ty))


@triton.jit
def _gemv_swiglu(x, w, out, I, K, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[j] = silu(w[j] . x) * (w[I + j] . x), each projection rounded like linear, then like swiglu."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    j = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    m = cols < K
    b_g = tl.load(w + j * K + cols, mask=m, other=0.0)
    b_u = tl.load(w + (I + j) * K + cols, mask=m, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    b_x = tl.load(x + cols, mask=m, other=0.0).to(tl.float32)
    acc_g = b_g.to(tl.float32) * b_x
    acc_u = b_u.to(tl.float32) * b_x
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = cols < K
        b_x = tl.load(x + cols, mask=m, other=0.0).to(tl.float32)
        acc_g += tl.load(w + j * K + cols, mask=m, other=0.0).to(tl.float32) * b_x
        acc_u += tl.load(w + (I + j) * K + cols, mask=m, other=0.0).to(tl.float32) * b_x
    g = tl.sum(acc_g, axis=0).to(out.dtype.element_ty).to(tl.float32)
    u = tl.sum(acc_u, axis=0).to(out.dtype.element_ty).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + j, (silu * u).to(out.dtype.element_ty))


@torch.library.custom_op("probe::swiglu_down", mutates_args=())
def swiglu_down(gu: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if gu.numel() != 2 * k:
        return F.linear(swiglu(gu), w)
    out = torch.empty(n, dtype=gu.dtype, device=gu.device)
    _swiglu_gemv[(n,)](gu.contiguous(), w, out, n, k, BLOCK_K=1024, **launch(gu.device))
    return out.view(*gu.shape[:-1], n)


@swiglu_down.register_fake
def _(gu, w):
    return gu.new_empty(*gu.shape[:-1], w.shape[0])


@torch.library.custom_op("probe::gate_swiglu", mutates_args=())
def gate_swiglu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if x.numel() != k:
        return swiglu(F.linear(x, w))
    out = torch.empty(n // 2, dtype=x.dtype, device=x.device)
    _gemv_swiglu[(n // 2,)](x.contiguous(), w, out, n // 2, k, BLOCK_K=1024, **launch(x.device))
    return out.view(*x.shape[:-1], n // 2)


@gate_swiglu.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0] // 2)


def mlp_down(self, x):
    return self.reduce(swiglu_down(self.gate_up_proj(x), self.down_proj.weight))


def mlp_gate(self, x):
    down = self.down_proj
    return self.reduce(self.kernels.linear(gate_swiglu(x, self.gate_up_proj.weight), down.weight, down.bias))


if mlp != "plain":
    llama.MLP.forward = {"down": mlp_down, "gate": mlp_gate}[mlp]
prompts = [json.loads(l) for l in open(".fixtures/prompts_code.jsonl")][:2]
program, _, _ = build_systems(BenchSpec(Recipe.from_yaml("recipes/tree.yaml"), prompts, 128, 1, ("ar",), "llama-3-8b"))
ar = program.autoregressive()
ids = [program.encode(p["prompt"]) for p in prompts]
outs = [ar.generate(i, 128).output_ids for i in ids]
ms = []
for _ in range(3):
    for i, o in zip(ids, outs):
        g = ar.generate(i, 128)
        assert g.output_ids == o
        ms.append((g.seconds - g.first_token_seconds) / (len(g.output_ids) - 1) * 1e3)
bw = measure_copy_bandwidth(torch.device("cuda")) / 1e12
print(f"{name}: ar {sorted(ms)[3]:.3f} ms/token {['%.3f' % m for m in ms]} copy {bw:.3f} TB/s prompt tokens "
      f"{[len(i) for i in ids]} outputs {hash(str(outs)) % 10**8} first {outs[0][:6]}", flush=True)
