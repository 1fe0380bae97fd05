# One-off probe, kept for the record: run 11 in docs/benchmarks.md (from the repository root, PYTHONPATH=.:/tmp/site, OUT set).
"""Microbenchmarks inside CUDA graphs: step attention variants for one query; a Triton GEMV vs cuBLAS."""
import itertools, math, json, os
import torch, triton, triton.language as tl
from specgraph.kernels.attention import triton as at
from specgraph.runtime.stage import step_mask

dev = "cuda"
def graph_time(fn, reps=20):
    fn(0); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / 10 / reps * 1e3  # us per call

res = {}
# attention: 1 query, 32 heads over 8 KV heads, D 128, cache 2100, prefix 300 (8 layers' caches rotate)
H, HKV, D, S = 32, 8, 128, 2100
ks = [torch.randn(1, HKV, S, D, device=dev, dtype=torch.bfloat16) for _ in range(8)]
vs = [torch.randn(1, HKV, S, D, device=dev, dtype=torch.bfloat16) for _ in range(8)]
q = torch.randn(1, H, 1, D, device=dev, dtype=torch.bfloat16)
for prefix in (300, 1000):
    slots = torch.tensor([prefix], device=dev)
    mask = step_mask(torch.tensor(prefix, device=dev), torch.ones(1, 1, dtype=torch.bool, device=dev), S)
    res[f"attn sdpa-capacity p{prefix}"] = graph_time(lambda i: torch.nn.functional.scaled_dot_product_attention(q, ks[i % 8], vs[i % 8], attn_mask=mask, enable_gqa=True))
    res[f"attn triton-now p{prefix}"] = graph_time(lambda i: at.attention(q, ks[i % 8], vs[i % 8], mask, slots))
    orig = at._step_attention
    for splits, bn, warps in itertools.product((1, 2, 4, 8), (32, 64, 128), (4,)):
        def run(i, splits=splits, bn=bn, warps=warps):
            part_o = torch.empty(HKV * splits * 4, D, dtype=torch.float32, device=dev)
            part_m = torch.empty(HKV * splits * 4, dtype=torch.float32, device=dev); part_l = torch.empty_like(part_m)
            out = torch.empty_like(q)
            key = (q.device, HKV)
            if key not in at._COUNTERS:
                at._COUNTERS[key] = torch.zeros(HKV, dtype=torch.int32, device=dev)
            k, v = ks[i % 8], vs[i % 8]
            orig[(HKV, 1, splits)](q, k, v, mask.view(torch.uint8), slots, part_o, part_m, part_l, at._COUNTERS[key], out,
                1, HKV, 4, 1 / math.sqrt(D), q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), mask.stride(0), out.stride(0), out.stride(1), out.stride(2),
                GROUP=4, SPLITS=splits, BLOCK_M=16, BLOCK_N=bn, BLOCK_T=16, D=D, BLOCK_D=D, num_warps=warps)
            return out
        try:
            res[f"attn s{splits} n{bn} w{warps} p{prefix}"] = graph_time(run)
        except Exception as exc:
            res[f"attn s{splits} n{bn} w{warps} p{prefix}"] = str(exc)[:80]

@triton.jit
def _gemv(x, w, out, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        b_x = tl.load(x + cols).to(tl.float32)
        b_w = tl.load(w + rows[:, None] * K + cols[None, :]).to(tl.float32)
        acc += b_w * b_x[None, :]
    tl.store(out + rows, tl.sum(acc, 1).to(out.dtype.element_ty))

bw_bytes = {}
for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(6)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    nbytes = n * k * 2
    t = graph_time(lambda i: torch.nn.functional.linear(x, ws[i % 6]))
    res[f"gemv {n}x{k} cublas"] = (t, nbytes / t / 1e6)
    for bn, bk, warps, stages in itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 3)):
        out = torch.empty(n, device=dev, dtype=torch.bfloat16)
        try:
            t = graph_time(lambda i: _gemv[(n // bn,)](x, ws[i % 6], out, n, k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages))
            res[f"gemv {n}x{k} n{bn} k{bk} w{warps} s{stages}"] = (t, nbytes / t / 1e6)
        except Exception as exc:
            res[f"gemv {n}x{k} n{bn} k{bk} w{warps} s{stages}"] = str(exc)[:80]
    ref = torch.nn.functional.linear(x, ws[0]).float()
    got = torch.empty(n, device=dev, dtype=torch.bfloat16); _gemv[(n // 8,)](x, ws[0], got, n, k, BLOCK_N=8, BLOCK_K=512)
    res[f"gemv {n}x{k} maxdiff"] = (got.float() - ref[0]).abs().max().item()
    del ws
json.dump(res, open(os.path.join(os.environ["OUT"], "micro.json"), "w"), indent=0)
def best(prefix):
    items = [(v if not isinstance(v, (list, tuple)) else v[0], kk) for kk, v in res.items() if kk.startswith(prefix) and not isinstance(v, str)]
    return sorted(items)[:4]
for p in ("attn sdpa-capacity p300", "attn triton-now p300", "attn s", ):
    print(p, best(p))
for kk, v in res.items():
    if "cublas" in kk or "maxdiff" in kk or "now" in kk or "sdpa" in kk: print(kk, v)
for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
    print(n, k, best(f"gemv {n}x{k} n"))
print("p1000", sorted((v, kk) for kk, v in res.items() if kk.startswith("attn s") and kk.endswith("p1000") and not isinstance(v, str))[:4])
