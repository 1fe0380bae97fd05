"""Triton SwiGLU: reads gate and up once, writes silu(gate) * up (one pass instead of three)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specgraph.kernels.pdl import launch


@triton.jit
def _swiglu(gate_up, out, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    gate = tl.load(gate_up + row * 2 * I + cols, mask=m, other=0.0)
    up = tl.load(gate_up + row * 2 * I + I + cols, mask=m, other=0.0)
    silu = (gate.to(tl.float32) * tl.sigmoid(gate.to(tl.float32))).to(gate.dtype)  # rounded like F.silu
    tl.store(out + row * I + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(out.dtype.element_ty), mask=m)


@torch.library.custom_op("specgraph::swiglu", mutates_args=())
def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """Same signature and result as swiglu_reference."""
    i = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * i).contiguous()
    out = torch.empty(rows.shape[0], i, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(i))
    _swiglu[(rows.shape[0], triton.cdiv(i, block))](rows, out, i, BLOCK=block, **launch(gate_up.device))
    return out.view(*gate_up.shape[:-1], i)


@swiglu.register_fake
def _(gate_up):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
