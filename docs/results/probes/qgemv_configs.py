# One-off probe, kept for the record (docs/benchmarks.md, run 129): the int4 few-row kernel (`_qgemv`,
# specgraph/kernels/qlinear/triton.py) at the Llama-3-8B projection shapes, 1 to 16 rows, over weight rows a
# program and warps (also at 8 and 16 rows, beyond the rows it takes), against the tiles (`project_quantized`) and
# bf16 (`linear`); then the tiles against the
# dequantizing reference and qlinear (its weight dequantized by one kernel, then cuBLAS) past its MAX_ROWS (a
# verification of 128-512 rows). us a call, CUDA-graph replays
# cycling through weight copies (more bytes than the L2 holds). `python3 docs/results/probes/qgemv_configs.py` at
# code `2bf3b56`, where `_qgemv` and `project_few` existed: slower than the tiles, they went after this run.
import torch
import triton
import triton.language as tl

from specgraph.bench.timing import graph_time_us
from specgraph.kernels.linear.triton import linear
from specgraph.kernels.qlinear import qlinear_reference
from specgraph.kernels.qlinear.triton import project_few, project_quantized, qlinear
from specgraph.models.widen import SHAPES as WIDE
from specgraph.quant.quantize import quantize_linear



@triton.jit
def _tile_nk(x, w, scales, zeros, out, M, N, K, s_xm, s_w, s_s, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A variant of the int4 tiles for the record: words loaded [BN, BK/8] as they lie (K contiguous), one group a
    tile, no K split: out[M, N] = x @ dequantized w^T."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_rows, m_cols = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    shifts = tl.arange(0, 8) * 4
    for k0 in range(0, K, BLOCK_K):
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        b_words = tl.load(w + cols[:, None] * s_w + words[None, :], mask=m_cols[:, None], other=0)  # [BN, BK/8]
        b_q = tl.reshape((b_words[:, :, None] >> shifts[None, None, :]) & 15, [BLOCK_N, BLOCK_K])  # [BN, BK]
        g = k0 // GROUP
        b_z = tl.load(zeros + cols * s_s + g, mask=m_cols, other=0).to(tl.int32)
        b_s = tl.load(scales + cols * s_s + g, mask=m_cols, other=0.0).to(tl.float32)
        b_w = ((b_q - b_z[:, None]).to(tl.float32) * b_s[:, None]).to(tl.bfloat16)  # [BN, BK]
        ks = k0 + tl.arange(0, BLOCK_K)
        b_x = tl.load(x + rows[:, None] * s_xm + ks[None, :], mask=m_rows[:, None], other=0.0)  # [BM, BK]
        acc = tl.dot(b_x, tl.trans(b_w), acc)
    tl.store(out + rows[:, None] * N + cols[None, :], acc.to(tl.bfloat16), mask=m_rows[:, None] & m_cols[None, :])


def tile_nk(x, layer, block_n, block_m=16, warps=4, stages=3):
    m, k = x.shape
    n = layer.weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _tile_nk[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, layer.weight, layer.scales, layer.zeros, out, m, n, k, x.stride(0), layer.weight.stride(0),
        layer.scales.stride(0), GROUP=layer.group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps,
        num_stages=stages)
    return out


device = torch.device("cuda")
for name, (n, k) in WIDE["llama-3-8b"][0].projections().items():
    if name == "lm_head":
        continue
    dense = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    layers = [quantize_linear(dense, "w4a16", 128) for _ in range(max(1, -(-(256 << 20) // (n * k // 2))))]
    denses = [dense.weight.clone() for _ in range(max(1, -(-(256 << 20) // (n * k * 2))))]
    turn = [0]

    def cycled(items):
        turn[0] = (turn[0] + 1) % len(items)
        return items[turn[0] % len(items)]

    def args(layer):
        return layer.weight, layer.scales, layer.zeros, None, layer.format, layer.group

    bytes_int4 = layers[0].bytes
    for rows in (1, 4, 8, 16):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        expected = qlinear_reference(x.float(), *args(layers[0]))
        got = project_few(x, *args(layers[0]))
        assert ((got.float() - expected).abs() / expected.abs().clamp(min=1)).max() < 2e-2, (name, rows)
        base = {"bf16": graph_time_us(lambda: linear(x, cycled(denses), None)),
                "tiles": graph_time_us(lambda: project_quantized(x, *args(cycled(layers))))}
        line = [f"{name:13s} rows {rows}: bf16 {base['bf16']:6.1f} tiles {base['tiles']:6.1f} |"]
        best = None
        for block_n in (1, 2, 4, 8, 16) if rows <= 4 else (1, 2, 4):
            for warps in (1, 2, 4, 8) if rows <= 4 else (2, 4, 8):
                if block_n * 1024 // warps > 4096:  # (over 128 values a thread)
                    continue
                us = graph_time_us(lambda: project_few(x, *args(cycled(layers)), block_n=block_n, num_warps=warps))
                line.append(f"{block_n}/{warps} {us:5.1f}")
                best = min(best or (us, block_n, warps), (us, block_n, warps))
        print(" ".join(line), flush=True)
        print(f"{name:13s} rows {rows}: best {best[1]} rows/{best[2]} warps {best[0]:.1f} us = "
              f"{base['bf16'] / best[0]:.2f}x bf16, {bytes_int4 / best[0] / 1e6:.2f} TB/s", flush=True)
    for rows in (8, 16, 64, 128):  # the variant tiles
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        expected = qlinear_reference(x.float(), *args(layers[0]))
        line = [f"{name:13s} rows {rows}: variant tiles (BN/BM/warps)"]
        for block_n, block_m, warps in ((16, 16, 4), (32, 16, 4), (64, 16, 4), (32, 32, 4), (64, 64, 4)):
            if block_m > max(16, rows):
                continue
            got = tile_nk(x, layers[0], block_n, block_m, warps)
            assert ((got.float() - expected).abs() / expected.abs().clamp(min=1)).max() < 2e-2, (name, rows, block_n)
            us = graph_time_us(lambda: tile_nk(x, cycled(layers), block_n, block_m, warps))
            line.append(f"{block_n}/{block_m}/{warps} {us:6.1f}")
        print(" ".join(line), flush=True)
    for rows in (128, 256, 512):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        tiles = graph_time_us(lambda: project_quantized(x, *args(cycled(layers))), replays=50)
        reference = graph_time_us(lambda: qlinear_reference(x, *args(cycled(layers))), replays=20)
        same = torch.equal(qlinear(x, *args(layers[0])), qlinear_reference(x, *args(layers[0])))
        ours = graph_time_us(lambda: qlinear(x, *args(cycled(layers))), replays=50)  # (_dequantize, then cuBLAS)
        bf16 = graph_time_us(lambda: linear(x, cycled(denses), None))
        print(f"{name:13s} rows {rows}: tiles {tiles:7.1f} reference {reference:7.1f} qlinear {ours:7.1f} "
              f"bf16 {bf16:6.1f} (qlinear's bits the reference's: {same})", flush=True)
