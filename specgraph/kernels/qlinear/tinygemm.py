"""torch's tinygemm int4 kernel (`aten._weight_int4pack_mm`, the one gpt-fast and torchao use) for the few rows of
decoding. On an H100 at the Llama-3-8B shapes it ran 1.8-2.4x bf16 at 1 row and ahead of our int4 tiles to 8 rows,
behind them from 16 (scripts/bench_qlinear.py, runs 139 and 143). It reads a layout of its own: `use_tinygemm` gives
each int4 QuantLinear of a stage whose qlinear kernel is Triton (not row-invariant: tinygemm's sums depend on its
own tiling) a copy of its weight in that layout, as much memory again as the packed weight, and checks the first
against the reference on this machine; `Kernels.project` sends up to TINYGEMM_ROWS rows of bf16 through it."""

from __future__ import annotations

import logging

import torch
from torch import nn

from specgraph.kernels.qlinear.reference import qlinear_reference
from specgraph.quant.linear import QuantLinear, unpack

log = logging.getLogger("specgraph")

TINYGEMM_ROWS = 8  # the most rows projected through tinygemm (at 16 our tiles were faster: run 143)
GROUPS = (32, 64, 128, 256)  # the group sizes tinygemm supports
INNER_K_TILES = 8


def tinygemm_layout(module: QuantLinear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An int4 QuantLinear's weight in tinygemm's layout: (packed weight, scales_and_zeros [K / group, N, 2] bf16,
    w = (q - 8) * s + (8 - z) * s, which is (q - z) * s); None where tinygemm does not apply (another format or
    group, a K or N its tiles do not divide). On the CPU, torch's CPU variant of the layout (for tests)."""
    n, k = module.out_features, module.in_features
    if module.format != "int4" or module.group not in GROUPS or k % (INNER_K_TILES * 16) or n % 16:
        return None
    values = unpack(module.weight, 4, k)  # [N, K] uint8
    if module.weight.is_cuda:  # (two values a byte, the first in the high bits)
        packed = torch.ops.aten._convert_weight_to_int4pack((values[:, ::2] << 4 | values[:, 1::2]).contiguous(),
                                                            INNER_K_TILES)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), INNER_K_TILES)
    scales = module.scales.float().t()  # [K / group, N]
    offsets = (8 - module.zeros.float().t()) * scales
    return packed, torch.stack((scales, offsets), dim=-1).to(torch.bfloat16).contiguous()


def project_tinygemm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] bf16 through a weight in tinygemm's layout -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    if packed.is_cuda:
        out = torch.ops.aten._weight_int4pack_mm(rows, packed, group, scales_and_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group, scales_and_zeros)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


def use_tinygemm(model: nn.Module) -> None:
    """Give each int4 QuantLinear of `model` (on a GPU, in bf16) its weight in tinygemm's layout, once the first
    projects within 2e-2 of the reference on this machine (else none, with a warning: a torch whose layout differs)."""
    modules = [m for m in model.modules() if isinstance(m, QuantLinear) and m.weight.is_cuda]
    layouts = [(m, layout) for m in modules if (layout := tinygemm_layout(m)) is not None]
    if not layouts:
        return
    first, (packed, scales_and_zeros) = layouts[0]
    x = torch.randn(3, first.in_features, device=packed.device, dtype=torch.bfloat16,
                    generator=torch.Generator(packed.device).manual_seed(0))
    expected = qlinear_reference(x.float(), first.weight, first.scales.float(), first.zeros, None, "int4", first.group)
    got = project_tinygemm(x, packed, scales_and_zeros, first.group, None).float()
    error = float(((got - expected).abs() / expected.abs().clamp(min=1)).max())
    if error > 2e-2:
        log.warning("tinygemm's int4 projection is off by %.3g of the reference on this torch: not used", error)
        return
    for module, (packed, scales_and_zeros) in layouts:
        module.tinygemm_weight, module.tinygemm_scales = packed, scales_and_zeros
    log.info("tinygemm copies of %d int4 projections (%.2f GB) for up to %d rows", len(layouts),
             sum(p.numel() * p.element_size() + s.numel() * s.element_size() for _, (p, s) in layouts) / 1e9,
             TINYGEMM_ROWS)
