"""Triton projection of one token (decoding's matrix-vector product) or a few.

For a single token, cuBLAS splits the long K of the output and down projections over programs and
adds the parts in a second kernel. Here a program takes one weight row (BLOCK_N) and walks all of
K, reading each weight once with fp32 accumulation: one kernel, which on an H200 ran 2 us (o_proj,
4096 x 4096) and 1 us (down_proj, 4096 x 14336) faster than cuBLAS (docs/benchmarks.md). Launched
dependently, its programs load their first weight tile before the activations exist.

Two to FEW_ROWS tokens (a drafter's tree levels, a catch-up) go to the tensor-core tiles of
invariant.py (one read of the weights, each program's launch overlapping the kernel before; its
loads wait for it): on an H200 they ran 0.4-1.7 us faster than cuBLAS per o, down and logits
projection of 2-16 tokens at the Llama-3.2-1B, 3B and Llama-3-8B shapes (docs/benchmarks.md, run
63). More tokens (tree verification, prefill) go to cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specgraph.kernels.linear.invariant import project_rows
from specgraph.kernels.pdl import launch

FEW_ROWS = 16  # the most tokens projected by tensor-core tiles rather than cuBLAS (past 16, the 1B drafter's
# qkv and down lose more to cuBLAS than its head gains: scripts/bench_few_rows.py, run 105 on an H100)


@triton.jit
def _gemv(x, w, bias, out, N, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_rows = rows < N
    cols = tl.arange(0, BLOCK_K)
    m = cols < K
    b_w = tl.load(w + rows[:, None] * K + cols[None, :], mask=m_rows[:, None] & m[None, :], other=0.0)  # weights: no wait
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the kernel before's output
    b_x = tl.load(x + cols, mask=m, other=0.0).to(tl.float32)  # [BK]
    acc = b_w.to(tl.float32) * b_x[None, :]  # [BN, BK]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        m = cols < K
        b_x = tl.load(x + cols, mask=m, other=0.0).to(tl.float32)
        b_w = tl.load(w + rows[:, None] * K + cols[None, :], mask=m_rows[:, None] & m[None, :], other=0.0)
        acc += b_w.to(tl.float32) * b_x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias + rows, mask=m_rows, other=0.0).to(tl.float32)
    tl.store(out + rows, y.to(out.dtype.element_ty), mask=m_rows)


@torch.library.custom_op("specgraph::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Same signature and result as linear_reference."""
    n, k = weight.shape
    if x.numel() > FEW_ROWS * k:  # many tokens
        return F.linear(x, weight, bias)
    if x.numel() != k:  # a few
        return project_rows(x, weight, bias)
    if weight.stride() != (k, 1):
        raise ValueError("the one-token projection needs a contiguous [N, K] weight")
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    # A GPU: a program per row, the fastest measured with dependent launch (docs/benchmarks.md, run 20).
    # The CPU's interpreter runs programs one by one in Python: 64 rows each, every row summed alike.
    block_n = 1 if x.is_cuda else 64
    _gemv[(triton.cdiv(n, block_n),)](x.contiguous(), weight, bias if bias is not None else out, out, n, k,
                                      HAS_BIAS=bias is not None, BLOCK_N=block_n,
                                      BLOCK_K=min(1024, triton.next_power_of_2(k)), **launch(x.device))
    return out.view(*x.shape[:-1], n)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
