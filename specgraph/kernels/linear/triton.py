"""Triton projections of a single token (decoding's matrix-vector products), with the op before
them computed as the input is read, so that it costs no kernel of its own:

  linear        x                        (the attention output projection)
  norm_linear   rmsnorm(x + delta)       (the qkv projection; program 0 also writes x + delta)
  swiglu_linear silu(gate) * up          (the down projection)

A program takes BLOCK_N weight rows and walks K in BLOCK_K steps, reading each weight once; each
program recomputes the (small, L2-resident) input it needs, so RMSNorm's statistics are summed by
every program over the whole row. Elementwise results are rounded to the input dtype op by op,
as the references' ops are. More than one token (tree verification, prefill) takes the references'
path through cuBLAS, with the Triton add + RMSNorm and SwiGLU kernels before it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specgraph.kernels.norm.triton import add_rmsnorm
from specgraph.kernels.swiglu.triton import swiglu

PLAIN, NORM, SWIGLU = 0, 1, 2


@triton.jit
def _input(x, delta, norm_weight, rstd, cols, m, K, PROLOGUE: tl.constexpr):
    """The projection's input at `cols`, in x's dtype."""
    dtype = x.dtype.element_ty
    if PROLOGUE == 0:
        value = tl.load(x + cols, mask=m, other=0.0)
    elif PROLOGUE == 1:
        total = (tl.load(x + cols, mask=m, other=0.0).to(tl.float32)
                 + tl.load(delta + cols, mask=m, other=0.0).to(tl.float32)).to(dtype)
        normed = (total.to(tl.float32) * rstd).to(dtype)
        value = (tl.load(norm_weight + cols, mask=m, other=0.0).to(tl.float32) * normed.to(tl.float32)).to(dtype)
    else:
        gate = tl.load(x + cols, mask=m, other=0.0).to(tl.float32)
        up = tl.load(x + K + cols, mask=m, other=0.0).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(dtype)
        value = (silu.to(tl.float32) * up).to(dtype)
    return value


@triton.jit
def _gemv(x, delta, norm_weight, total, w, bias, out, N, K, eps,
          PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_rows = rows < N
    rstd = 0.0
    if PROLOGUE == 1:  # statistics of x + delta; program 0 stores the sum (the residual stream)
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            m = cols < K
            s = (tl.load(x + cols, mask=m, other=0.0).to(tl.float32)
                 + tl.load(delta + cols, mask=m, other=0.0).to(tl.float32)).to(x.dtype.element_ty)
            if pid == 0:
                tl.store(total + cols, s, mask=m)
            squares += s.to(tl.float32) * s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = cols < K
        b_x = _input(x, delta, norm_weight, rstd, cols, m, K, PROLOGUE).to(tl.float32)  # [BK]
        b_w = tl.load(w + rows[:, None] * K + cols[None, :], mask=m_rows[:, None] & m[None, :], other=0.0)
        acc += b_w.to(tl.float32) * b_x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias + rows, mask=m_rows, other=0.0).to(tl.float32)
    tl.store(out + rows, y.to(out.dtype.element_ty), mask=m_rows)


def _single_token(x: torch.Tensor) -> bool:
    return x.numel() == x.shape[-1]


def _launch(prologue: int, x, delta, norm_weight, eps, weight, bias, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's projection [N] (and, for NORM, x + delta [K])."""
    n = weight.shape[0]
    if weight.stride() != (k, 1):
        raise ValueError("the token projections need a contiguous [N, K] weight")
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    total = torch.empty(k, dtype=x.dtype, device=x.device) if prologue == NORM else out
    # rows per program: enough programs to fill the GPU; fewer where each re-reads more input
    block_n = {PLAIN: 4, NORM: 16, SWIGLU: 8}[prologue]
    _gemv[(triton.cdiv(n, block_n),)](
        x.contiguous(), delta.contiguous() if delta is not None else x, norm_weight if norm_weight is not None else x,
        total, weight, bias if bias is not None else out, out, n, k, eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=min(1024, triton.next_power_of_2(k)),
        num_warps=4)
    return total, out


@torch.library.custom_op("specgraph::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Same signature and result as linear_reference."""
    if not _single_token(x):
        return F.linear(x, weight, bias)
    k = x.shape[-1]
    return _launch(PLAIN, x, None, None, 0.0, weight, bias, k)[1].view(*x.shape[:-1], -1)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("specgraph::norm_linear", mutates_args=())
def norm_linear(x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as norm_linear_reference."""
    if not _single_token(x):
        total, normed = add_rmsnorm(x, delta, norm_weight, eps)
        return total, F.linear(normed, weight, bias)
    k = x.shape[-1]
    total, out = _launch(NORM, x, delta, norm_weight, eps, weight, bias, k)
    return total.view(x.shape), out.view(*x.shape[:-1], -1)


@norm_linear.register_fake
def _(x, delta, norm_weight, eps, weight, bias):
    return torch.empty_like(x), x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("specgraph::swiglu_linear", mutates_args=())
def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Same signature and result as swiglu_linear_reference."""
    if not _single_token(gate_up):
        return F.linear(swiglu(gate_up), weight, bias)
    return _launch(SWIGLU, gate_up, None, None, 0.0, weight, bias, gate_up.shape[-1] // 2)[1].view(*gate_up.shape[:-1], -1)


@swiglu_linear.register_fake
def _(gate_up, weight, bias):
    return gate_up.new_empty(*gate_up.shape[:-1], weight.shape[0])
