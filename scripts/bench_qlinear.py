"""The quantized projection at the Llama-3-8B layer shapes on a GPU, in one run: for 1 to 256 rows,
microseconds per call of our int4 kernel (groups of 128; `qlinear`, specgraph/kernels/qlinear/triton.py: the tiles
to MAX_ROWS, the weight dequantized then cuBLAS above), our int8 (w8a16, a scale per row) and fp8 kernels, the
bf16 path (`linear`: our one-token kernel, tiles to 16 rows, cuBLAS above) and tinygemm
(`torch.ops.aten._weight_int4pack_mm`, groups of 128, the kernel gpt-fast and torchao use), each timed over
CUDA-graph replays that cycle through copies of the weight (more bytes than the L2 holds, so every call reads
HBM), with the bandwidth each reaches and our int4's speedup over bf16; where gemlite imports (a Triton low-bit GEMM
library, carried as a wheel: issue 57 asks for it side by side), its int4 kernels on the same weights (groups of 128,
bf16; its configs for an H100, loaded on any Hopper card so that it does not autotune for minutes). Each of our kernels is first checked
against its reference. Past the least of MAX_ROWS the tiles (`project_quantized`) are timed beside qlinear (which
dequantizes past its format's MAX_ROWS), to place MAX_ROWS (run 143). Run from the repository root
after scripts/gpu_setup.sh: `python3 scripts/bench_qlinear.py`."""
from pathlib import Path

import torch

from specgraph.bench.harness import measure_copy_bandwidth
from specgraph.bench.timing import graph_time_us
from specgraph.kernels.linear.triton import linear
from specgraph.kernels.qlinear import qlinear_reference
from specgraph.kernels.qlinear.triton import MAX_ROWS, project_quantized, qlinear
from specgraph.models.widen import SHAPES as WIDE
from specgraph.quant.linear import unpack
from specgraph.quant.quantize import quantize_linear

try:
    import gemlite
except Exception as error:  # (absent, or built for another triton)
    print(f"no gemlite column: {type(error).__name__}: {error}")
    gemlite = None

SHAPES = {name: nk for name, nk in WIDE["llama-3-8b"][0].projections().items() if name != "lm_head"}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
L2_BYTES = 256 << 20  # cycle through at least this many bytes of weights

device = torch.device("cuda")
if gemlite is not None and "h100" not in torch.cuda.get_device_name().lower():  # (its configs name the H100 only)
    gemlite.load_config(str(Path(gemlite.__file__).parent / "configs" / "h100.json"))


def gemlite_int4(layer):
    """gemlite's int4 projection of a w4a16 QuantLinear's values, scales and zeros ((q - z) * s, as ours)."""
    n, k = layer.weight.shape[0], layer.scales.shape[1] * layer.group
    linear = gemlite.GemLiteLinear(4, group_size=layer.group, in_features=k, out_features=n,
                                   input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.BF16)
    linear.pack(unpack(layer.weight, 4, k).to(torch.uint8), layer.scales.to(torch.bfloat16),
                layer.zeros.to(torch.bfloat16), None, fma_mode=False)  # (its default folds -z * s in bf16: run 143)
    return linear


bandwidth = measure_copy_bandwidth(device)
print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
print("shape          rows  bf16 us  int4 us  int8 us  fp8 us  tinygemm us  int4/bf16  int4 TB/s  tinygemm TB/s  "
      "tiles past MAX_ROWS: int4 us  int8 us  fp8 us" + ("  gemlite int4 us  gemlite/bf16" if gemlite else ""))
for name, (n, k) in SHAPES.items():
    dense = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    int4, int8, fp8 = (quantize_linear(dense, "w4a16", 128), quantize_linear(dense, "w8a16"),
                       quantize_linear(dense, "fp8"))
    q = torch.randint(0, 16, (n, k), device=device, dtype=torch.int32)
    tiny = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    tiny_scales = torch.rand(k // 128, n, 2, device=device, dtype=torch.bfloat16)
    copies = max(1, -(-L2_BYTES // (n * k // 2)))
    weights = {"bf16": [dense.weight.clone() for _ in range(max(1, -(-L2_BYTES // (n * k * 2))))],
               "int4": [quantize_linear(dense, "w4a16", 128) for _ in range(copies)],
               "int8": [quantize_linear(dense, "w8a16") for _ in range(-(-L2_BYTES // (n * k)))],
               "fp8": [quantize_linear(dense, "fp8") for _ in range(-(-L2_BYTES // (n * k)))],
               "tinygemm": [tiny.clone() for _ in range(copies)]}
    if gemlite is not None:
        try:
            weights["gemlite"] = [gemlite_int4(layer) for layer in weights["int4"]]
            for rows in (1, 16):
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                expected = qlinear_reference(x.float(), int4.weight, int4.scales.float(), int4.zeros, None, "int4", 128)
                error = ((weights["gemlite"][0](x).float() - expected).abs() / expected.abs().clamp(min=1)).max()
                assert error < 2e-2, f"{rows} rows: its largest relative error {float(error):.3g}"
        except Exception as error:  # (a library's fault must not cost the call our own figures)
            print(f"gemlite: {type(error).__name__}: {error}; its column dropped")
            gemlite = None
    for rows in ROWS:
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        for layer in (int4, int8, fp8):
            args = (layer.weight, layer.scales, layer.zeros, None, layer.format, layer.group)
            expected = qlinear_reference(x.float(), layer.weight, layer.scales.float(), layer.zeros, None, layer.format,
                                         layer.group)
            error = ((qlinear(x, *args).float() - expected).abs() / expected.abs().clamp(min=1)).max()
            assert error < 2e-2, (name, rows, layer.format, float(error))
        turn = {key: 0 for key in weights}

        def cycled(key):
            turn[key] = (turn[key] + 1) % len(weights[key])
            return weights[key][turn[key]]

        def quantized(key, through=qlinear):
            layer = cycled(key)
            return through(x, layer.weight, layer.scales, layer.zeros, None, layer.format, layer.group)

        times = {"bf16": graph_time_us(lambda: linear(x, cycled("bf16"), None)),
                 "int4": graph_time_us(lambda: quantized("int4")), "int8": graph_time_us(lambda: quantized("int8")),
                 "fp8": graph_time_us(lambda: quantized("fp8")),
                 "tinygemm": graph_time_us(lambda: torch.ops.aten._weight_int4pack_mm(x, cycled("tinygemm"), 128,
                                                                                      tiny_scales))}
        past = rows > min(MAX_ROWS.values())  # (where qlinear may dequantize and call cuBLAS: the tiles beside it)
        tiles = "  ".join(f"{graph_time_us(lambda: quantized(key, project_quantized)):7.1f}"
                          for key in ("int4", "int8", "fp8")) if past else " " * 25
        if gemlite is not None:
            times["gemlite"] = graph_time_us(lambda: cycled("gemlite")(x))
            tiles += f"  {times['gemlite']:15.1f}  {times['bf16'] / times['gemlite']:11.2f}x"
        int4_bytes = int4.bytes + rows * k * 2 + rows * n * 2
        tiny_bytes = n * k // 2 + tiny_scales.numel() * 2 + rows * k * 2 + rows * n * 2
        print(f"{name:14s} {rows:4d} {times['bf16']:8.1f} {times['int4']:8.1f} {times['int8']:8.1f} "
              f"{times['fp8']:7.1f} {times['tinygemm']:12.1f} {times['bf16'] / times['int4']:9.2f}x "
              f"{int4_bytes / times['int4'] / 1e6:9.2f} {tiny_bytes / times['tinygemm'] / 1e6:13.2f}  {tiles}",
              flush=True)
