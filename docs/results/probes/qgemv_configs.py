# One-off probe, kept for the record (docs/benchmarks.md, run 129): the int4 few-row kernel (`_qgemv`,
# specgraph/kernels/qlinear/triton.py) at the Llama-3-8B projection shapes, 1 to 16 rows, over weight rows a
# program and warps (also at 8 and 16 rows, beyond the rows it takes), against the tiles (`project_quantized`) and
# bf16 (`linear`); then the tiles against the
# dequantizing reference past qlinear's MAX_ROWS (a verification of 128-512 rows). us a call, CUDA-graph replays
# cycling through weight copies (more bytes than the L2 holds). `python3 docs/results/probes/qgemv_configs.py`
import torch

from specgraph.bench.timing import graph_time_us
from specgraph.kernels.linear.triton import linear
from specgraph.kernels.qlinear import qlinear_reference
from specgraph.kernels.qlinear.triton import project_few, project_quantized
from specgraph.models.widen import SHAPES as WIDE
from specgraph.quant.quantize import quantize_linear

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
    for rows in (128, 256, 512):
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        tiles = graph_time_us(lambda: project_quantized(x, *args(cycled(layers))), replays=50)
        reference = graph_time_us(lambda: qlinear_reference(x, *args(cycled(layers))), replays=20)
        bf16 = graph_time_us(lambda: linear(x, cycled(denses), None))
        print(f"{name:13s} rows {rows}: tiles {tiles:7.1f} reference {reference:7.1f} bf16 {bf16:6.1f}", flush=True)
