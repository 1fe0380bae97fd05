"""Triton residual add + RMSNorm: one program per row reads x and delta once, writes the sum and
its normalisation (fp32 statistics, rounded like the reference); and RMSNorm alone, the same
program without the add, or times silu(gate) (a row's result never depends on how many rows a
call holds)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specgraph.kernels.pdl import launch


@triton.jit
def _add_rmsnorm(x, delta, weight, total, out, C, eps, ADD: tl.constexpr, GATE: tl.constexpr, BLOCK_C: tl.constexpr,
                 PDL: tl.constexpr):
    """ADD: normalise x + delta and store the sum in `total`; else normalise x (total unused). GATE:
    times silu(delta) (the gated norm; delta is the gate)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    m = cols < C
    b_w = tl.load(weight + cols, mask=m, other=0.0)  # a weight: no wait
    if PDL:
        tl.extra.cuda.gdc_wait()
    b_x = tl.load(x + row * C + cols, mask=m, other=0.0)
    if ADD:
        b_d = tl.load(delta + row * C + cols, mask=m, other=0.0)
        b_x = (b_x.to(tl.float32) + b_d.to(tl.float32)).to(b_x.dtype)  # rounded like x + delta
        tl.store(total + row * C + cols, b_x, mask=m)
    f = b_x.to(tl.float32)
    normed = (f * tl.rsqrt(tl.sum(f * f, axis=0) / C + eps)).to(b_x.dtype)
    y = (b_w.to(tl.float32) * normed.to(tl.float32)).to(out.dtype.element_ty)
    if GATE:
        g = tl.load(delta + row * C + cols, mask=m, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * (g * tl.sigmoid(g))).to(out.dtype.element_ty)
    tl.store(out + row * C + cols, y, mask=m)


@torch.library.custom_op("specgraph::add_rmsnorm", mutates_args=())
def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as add_rmsnorm_reference (x, delta contiguous [..., C])."""
    c = x.shape[-1]
    x2, d2 = x.reshape(-1, c).contiguous(), delta.reshape(-1, c).contiguous()
    total, out = torch.empty_like(x2), torch.empty_like(x2)
    _add_rmsnorm[(x2.shape[0],)](x2, d2, weight, total, out, c, eps, ADD=True, GATE=False,
                                 BLOCK_C=triton.next_power_of_2(c), **launch(x.device))
    return total.view(x.shape), out.view(x.shape)


@add_rmsnorm.register_fake
def _(x, delta, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("specgraph::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature and result as rmsnorm_reference (x [..., C], any strides; gate as x)."""
    c = x.shape[-1]
    x2 = x.reshape(-1, c).contiguous()
    g2 = x2 if gate is None else gate.reshape(-1, c).contiguous()
    out = torch.empty_like(x2)
    _add_rmsnorm[(x2.shape[0],)](x2, g2, weight, out, out, c, eps, ADD=False, GATE=gate is not None,
                                 BLOCK_C=triton.next_power_of_2(c), **launch(x.device))
    return out.view(x.shape)


@rmsnorm.register_fake
def _(x, weight, eps, gate=None):
    return torch.empty_like(x)
