"""Triton SwiGLU of the gate/up projection.

One token (decoding): a program projects the token on one gate row and its up row (on a GPU; the
CPU's interpreter, which runs programs one by one in Python, takes 64 of each), walking all of K
with fp32 accumulation, and stores silu(gate) * up, so the [2I] projection is never written and no
elementwise kernel follows (H200, Llama-3-8B shape: 0.15 ms per token less than cuBLAS and a SwiGLU
kernel, docs/benchmarks.md run 30). Launched dependently, its programs load their first
weight tiles before the token exists. Several tokens: cuBLAS projects, then one elementwise pass
reads gate and up once. Both round like the reference: each projection, then silu, then the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specgraph.kernels.pdl import launch


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up for fp32 values rounded to dtype, rounded like F.silu(gate) * up in dtype."""
    silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _gemv_swiglu(x, w, bias, out, I, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # gate rows j, up rows I + j
    m_rows = rows < I
    cols = tl.arange(0, BLOCK_K)
    m = m_rows[:, None] & (cols < K)[None, :]
    b_gate = tl.load(w + rows[:, None] * K + cols[None, :], mask=m, other=0.0)  # weights: no wait
    b_up = tl.load(w + (I + rows[:, None]) * K + cols[None, :], mask=m, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the kernel before's output
    b_x = tl.load(x + cols, mask=cols < K, other=0.0).to(tl.float32)  # [BK]
    acc_gate = b_gate.to(tl.float32) * b_x[None, :]  # [BN, BK]
    acc_up = b_up.to(tl.float32) * b_x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = m_rows[:, None] & (cols < K)[None, :]
        b_x = tl.load(x + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc_gate += tl.load(w + rows[:, None] * K + cols[None, :], mask=m, other=0.0).to(tl.float32) * b_x[None, :]
        acc_up += tl.load(w + (I + rows[:, None]) * K + cols[None, :], mask=m, other=0.0).to(tl.float32) * b_x[None, :]
    gate, up = tl.sum(acc_gate, axis=1), tl.sum(acc_up, axis=1)  # [BN]
    if HAS_BIAS:
        gate += tl.load(bias + rows, mask=m_rows, other=0.0).to(tl.float32)
        up += tl.load(bias + I + rows, mask=m_rows, other=0.0).to(tl.float32)
    dtype = out.dtype.element_ty
    tl.store(out + rows, _silu_mul(gate.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype), mask=m_rows)


@triton.jit
def _swiglu(gate_up, out, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    gate = tl.load(gate_up + row * 2 * I + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * 2 * I + I + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out + row * I + cols, _silu_mul(gate, up, out.dtype.element_ty), mask=m)


@torch.library.custom_op("specgraph::swiglu", mutates_args=())
def swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Same signature and result as swiglu_reference."""
    n, k = weight.shape
    i = n // 2
    if x.numel() == k:  # one token
        if weight.stride() != (k, 1):
            raise ValueError("the one-token SwiGLU projection needs a contiguous [2I, K] weight")
        out = torch.empty(i, dtype=x.dtype, device=x.device)
        # A GPU: a row a program. The interpreter runs programs one by one: 64 rows of 128 columns (a tile
        # tests/test_kernels_compile.py can still compile for Hopper in seconds; 64 x 1024 took minutes).
        block_n, block_k = (1, 1024) if x.is_cuda else (64, 128)
        _gemv_swiglu[(triton.cdiv(i, block_n),)](x.contiguous(), weight, bias if bias is not None else out, out, i, k,
                                                 HAS_BIAS=bias is not None, BLOCK_N=block_n,
                                                 BLOCK_K=min(block_k, triton.next_power_of_2(k)), **launch(x.device))
        return out.view(*x.shape[:-1], i)
    return silu_mul_rows(F.linear(x, weight, bias))


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (a projection: gate, then up) -> silu(gate) * up [..., I], one elementwise pass."""
    n = gate_up.shape[-1]
    i = n // 2
    rows = gate_up.reshape(-1, n)  # [tokens, 2I]
    out = torch.empty(rows.shape[0], i, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(i))
    _swiglu[(rows.shape[0], triton.cdiv(i, block))](rows, out, i, BLOCK=block, **launch(gate_up.device))
    return out.view(*gate_up.shape[:-1], i)


@swiglu.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)
