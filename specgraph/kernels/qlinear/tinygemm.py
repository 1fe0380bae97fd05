"""torch's tinygemm int4 kernel (`aten._weight_int4pack_mm`, the one gpt-fast and torchao use) for the few rows of
decoding. On an H100 at the Llama-3-8B shapes it ran 1.8-2.4x bf16 at 1 row and ahead of our int4 tiles to 8 rows,
behind them from 16 (scripts/bench_qlinear.py, runs 139 and 143). It reads a layout of its own: `use_tinygemm` gives
each int4 QuantLinear of a stage whose qlinear kernel is Triton (not row-invariant: tinygemm's sums depend on its
own tiling) a copy of its weight in that layout, as much memory again as the packed weight, once a copy of each
group size projects as the reference on this machine; `Kernels.project` sends 1 to TINYGEMM_ROWS rows of bf16
through it under Kernels made for Triton's qlinear (not an exported program's plain PyTorch)."""

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
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if packed.is_cuda:
        out = torch.ops.aten._weight_int4pack_mm(rows, packed, group, scales_and_zeros)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group, scales_and_zeros)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


def use_tinygemm(model: nn.Module) -> None:
    """Give each int4 QuantLinear of `model` on a GPU its weight in tinygemm's layout, where tinygemm applies and,
    checked once per group size on this machine, projects within 2e-2 of the reference (else a warning: a torch
    whose layout or kernel differs, or refuses)."""
    modules = [m for m in model.modules() if isinstance(m, QuantLinear) and m.weight.is_cuda]
    works: dict[int, bool] = {}
    copies = 0
    for module in modules:
        if works.get(module.group) is False:
            continue
        try:
            layout = tinygemm_layout(module)
            if layout is None:
                continue
            if module.group not in works:
                works[module.group] = _projects_as_the_reference(module, *layout)
                if not works[module.group]:
                    continue
        except RuntimeError as error:  # (a torch whose tinygemm refuses these shapes)
            log.warning("tinygemm's int4 kernel is not used for groups of %d: %s", module.group,
                        str(error).splitlines()[0])
            works[module.group] = False
            continue
        module.tinygemm_weight, module.tinygemm_scales = layout
        copies += sum(t.numel() * t.element_size() for t in layout)
    if copies:
        log.info("tinygemm copies of int4 projections (%.2f GB) for up to %d rows", copies / 1e9, TINYGEMM_ROWS)


def _projects_as_the_reference(module: QuantLinear, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> bool:
    """Whether tinygemm's projection of a few bf16 rows through this layout is within 2e-2 of the reference."""
    x = torch.randn(3, module.in_features, device=packed.device, dtype=torch.bfloat16,
                    generator=torch.Generator(packed.device).manual_seed(0))
    expected = qlinear_reference(x.float(), module.weight, module.scales.float(), module.zeros, None, "int4",
                                 module.group)
    got = project_tinygemm(x, packed, scales_and_zeros, module.group, None).float()
    error = float(((got - expected).abs() / expected.abs().clamp(min=1)).max())
    if error > 2e-2:
        log.warning("tinygemm's int4 projection is off by %.3g of the reference on this torch for groups of %d: "
                    "not used", error, module.group)
    return error <= 2e-2
