"""Row-invariant projection: each token's output row has the same bits whatever the step's token count.

cuBLAS and our one-token kernel pick another algorithm for 1, 21 or 128 rows — other tiles, a
split-K or none — so a token's projection rounds differently in a tree step than in a one-token
step. Here one tensor-core tile program serves every row count: BLOCK_N, BLOCK_K and a split of K
are chosen from the weight's shape alone, so a row's output is the same sequence of 16-row MMA
instructions over the same K blocks, summed over the K splits in one fixed order. Up to 16 rows
take one 16-row block, more take 32-row blocks (one read of the weights for a tree of up to 31
nodes); both multiply 16-row slices (mma.sync, never Hopper's 64-row wgmma), which
tests/test_gpu.py checks bit for bit. One token pads to 16 rows: decoding is bound by reading the
weights, which it does once (H200, Llama-3-8B shapes: docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specgraph.kernels.pdl import launch


@triton.jit(do_not_specialize=["M"])
def _project(x, w, bias, out, M, N, K, s_xm, CHUNK, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """out[split, M, N] = x[M, K-chunk] @ w[N, K-chunk]^T for the program's K chunk (+ bias, where
    K is one chunk and out is the result; else out holds fp32 partial sums)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # row blocks of a weight tile adjacent
    rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_rows, m_cols = rows < M, cols < N
    o_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the kernel before's output
    for k0 in range(i_s * CHUNK, tl.minimum(i_s * CHUNK + CHUNK, K), BLOCK_K):
        ks = k0 + o_k
        m_k = ks < K
        b_x = tl.load(x + rows[:, None] * s_xm + ks[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        b_w = tl.load(w + cols[None, :] * K + ks[:, None], mask=m_k[:, None] & m_cols[None, :], other=0.0)  # [BK, BN]
        if IEEE:  # fp32 weights: full-precision products, as cuBLAS gives them
            acc = tl.dot(b_x, b_w, acc, input_precision="ieee")
        else:
            acc = tl.dot(b_x, b_w, acc)
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=m_cols, other=0.0).to(tl.float32)[None, :]
    p_out = out + (i_s * M + rows[:, None]) * N + cols[None, :]
    tl.store(p_out, acc.to(out.dtype.element_ty), mask=m_rows[:, None] & m_cols[None, :])


@triton.jit
def sum_splits(part, bias, out, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                PDL: tl.constexpr):
    """out[M, N] = sum over splits, in order, of part[split, M, N] (+ bias)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < MN
    acc = tl.load(part + o, mask=m, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part + s * MN + o, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + o % N, mask=m, other=0.0).to(tl.float32)
    tl.store(out + o, acc.to(out.dtype.element_ty), mask=m)


def tiling(n: int, k: int, itemsize: int = 2, interpreted: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, K splits) for an [n, k] weight of `itemsize`-byte elements: a function of
    the weight (and device) alone, never of the row count (512-byte rows of K per tile, within shared
    memory). K is split where the outputs alone give fewer than ~384 programs (H200: 96 and 64
    blocks of outputs ran fastest split 4 ways, 448 and more unsplit: scripts/bench_invariant.py).
    `interpreted`: the CPU's interpreter, which runs programs one by one in Python: tiles 4x as wide
    (the projections of a test program on the fixture models ran 2.5x faster)."""
    block_n, block_k = 256 if interpreted else 64, 512 // itemsize
    splits = max(1, min(4, 384 // triton.cdiv(n, block_n), k // (2 * block_k)))
    return block_n, block_k, splits


def project_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 tiles: tuple[int, int, int] | None = None, **config) -> torch.Tensor:
    """x [..., K]; weight [N, K] contiguous -> [..., N] in x's dtype, each row the same bits for any
    row count. `tiles` (default: tiling(N, K, itemsize)) and `config` (num_warps, num_stages) for measurements."""
    n, k = weight.shape
    if weight.stride() != (k, 1):
        raise ValueError("the row-invariant projection needs a contiguous [N, K] weight")
    tiles = tiles or tiling(n, k, weight.element_size(), interpreted=not weight.is_cuda)
    block_n, block_k, _ = tiles

    def tile(grid, x2, m, chunk, block_m, part, bias, fused_bias, pdl):
        _project[grid](x2, weight, bias, part, m, n, k, x2.stride(0), chunk, HAS_BIAS=fused_bias, BLOCK_M=block_m,
                       BLOCK_N=block_n, BLOCK_K=block_k, IEEE=weight.dtype == torch.float32, **pdl,
                       **({"num_warps": 4, "num_stages": 3} | config))

    return in_tiles(x, n, bias, tiles, tile)


def in_tiles(x: torch.Tensor, n: int, bias: torch.Tensor | None, tiles: tuple[int, int, int], tile) -> torch.Tensor:
    """What the row-invariant projections share (this one and kernels/qlinear's): x [..., K] as rows,
    `tiles` = (BLOCK_N, BLOCK_K, K splits) chosen from the weight alone, 16-row blocks up to 16 rows and
    32-row ones above; `tile(grid, x2, M, chunk, BLOCK_M, part, bias, fused_bias, pdl)` launches the tile
    kernel writing `part` (the output where K is one chunk, `bias` added there where `fused_bias`; else
    fp32 partial sums [splits, M, N], then summed in order with the bias) -> [..., N] in x's dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    block_m = 16 if m <= 16 else 32
    block_n, block_k, splits = tiles
    chunk = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    pdl = launch(x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)  # [splits, M, N]
    has_bias, bias = bias is not None, bias if bias is not None else out
    tile((triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits), x2, m, chunk, block_m, part, bias,
         has_bias and splits == 1, pdl)
    if splits > 1:
        block = 1024
        sum_splits[(triton.cdiv(m * n, block),)](part, bias, out, m * n, n, SPLITS=splits, HAS_BIAS=has_bias,
                                                  BLOCK=block, **pdl)
    return out.view(*x.shape[:-1], n)


@torch.library.custom_op("specgraph::linear_invariant", mutates_args=())
def linear_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Same signature and result as linear_reference; every row's bits independent of the row count."""
    return project_rows(x, weight, bias)


@linear_invariant.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
