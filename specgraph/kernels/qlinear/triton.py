"""Triton projection through a quantized weight (specgraph/quant/linear.py's layout) for the row
counts decoding and speculation use (1 to MAX_ROWS[format]): each program dequantizes a [BLOCK_K, BLOCK_N]
tile of the weight in registers (int4/int8 words unpacked by shifts, less the group's zero point,
times its scale; fp8 bytes bitcast, times the row's scale) and multiplies it with its rows on the
tensor cores; K is split over programs where the outputs alone give few (the split sums added in a
fixed order by a second kernel). As in kernels/linear/invariant.py the tiling is a function of the
weight alone (16-row blocks up to 16 rows, 32-row blocks above), so each row's bits do not depend on
the row count: `qlinear_invariant` runs it for every row count (lowering.row_invariant). `qlinear` runs
it for up to MAX_ROWS[format] (int8's first 8 rows with a product per place in its words: other bits,
faster), the dequantized weight through cuBLAS above (prefill)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from specgraph.kernels import interpreted
from specgraph.kernels.linear.invariant import in_tiles
from specgraph.kernels.qlinear.reference import qlinear_reference
from specgraph.quant.linear import FORMATS

# the most rows `qlinear` projects with these tiles, by format: where they stop beating the weight dequantized then
# cuBLAS on an H100 at the 8B shapes (run 143: at 128 rows int8's tiles 1.7-1.9x faster, fp8's 1.1-1.5x on three
# of four shapes, int4's even; at 256 rows each slower)
MAX_ROWS = {"int4": 64, "int8": 128, "fp8": 128}


@triton.jit
def _dot(b_x, b_w, acc, DOT_F32: tl.constexpr):
    """acc + b_x [BM, BK] @ b_w [BK, BN] (fp32 weights): full-precision products for fp32 activations (and the
    CPU's interpreter, whose bf16 dot is wrong), else on the tensor cores in the activations' dtype."""
    if DOT_F32:
        return tl.dot(b_x.to(tl.float32), b_w, acc, input_precision="ieee")
    return tl.dot(b_x, b_w.to(b_x.dtype), acc)


@triton.jit(do_not_specialize=["M"])
def _qproject(x, w, scales, zeros, bias, out, M, N, K, s_xm, s_w, s_s, CHUNK, GROUP: tl.constexpr,
              BITS: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr, BY_PLACE: tl.constexpr,
              PDL: tl.constexpr):
    """out[split, M, N] = x[M, K-chunk] @ dequantized w[N, K-chunk]^T for the program's K chunk
    (+ bias where K is one chunk and out is the result; else out holds fp32 partial sums). BY_PLACE (int4/int8): a
    product per place in the words, with no reshape of the unpacked values (faster at a few rows, slower past 8)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_rows, m_cols = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if FP8:
        row_scale = tl.load(scales + cols * s_s, mask=m_cols, other=0.0).to(tl.float32)  # [BN]
    if PDL:
        tl.extra.cuda.gdc_wait()  # x is the kernel before's output
    for k0 in range(i_s * CHUNK, tl.minimum(i_s * CHUNK + CHUNK, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        m_k = ks < K
        if FP8:
            b_x = tl.load(x + rows[:, None] * s_xm + ks[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.0)
            b_q = tl.load(w + cols[None, :] * s_w + ks[:, None], mask=m_k[:, None] & m_cols[None, :], other=0)  # [BK, BN]
            acc = _dot(b_x, b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32), acc, DOT_F32)
        else:
            PER_WORD: tl.constexpr = 32 // BITS
            words = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)  # [BK / PER_WORD]
            b_words = tl.load(w + cols[None, :] * s_w + words[:, None], mask=m_cols[None, :], other=0)  # [BK/PW, BN]
            g = k0 // GROUP  # one group per tile (GROUP % BLOCK_K == 0)
            b_z = tl.load(zeros + cols * s_s + g, mask=m_cols, other=0).to(tl.int32)  # [BN]
            b_s = tl.load(scales + cols * s_s + g, mask=m_cols, other=0.0).to(tl.float32)  # [BN]
            if BY_PLACE:  # a product per place j in the words: rows k0 + PER_WORD * i + j against those columns of x
                for j in tl.static_range(PER_WORD):
                    b_q = (b_words >> (j * BITS)) & ((1 << BITS) - 1)  # [BK/PW, BN]
                    b_x = tl.load(x + rows[:, None] * s_xm + (words * PER_WORD + j)[None, :], mask=m_rows[:, None],
                                  other=0.0)  # [BM, BK/PW]
                    acc = _dot(b_x, (b_q - b_z[None, :]).to(tl.float32) * b_s[None, :], acc, DOT_F32)
            else:
                b_x = tl.load(x + rows[:, None] * s_xm + ks[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.0)
                shifts = tl.arange(0, PER_WORD) * BITS  # [PW]
                b_q = (b_words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [BK/PW, PW, BN]
                b_q = tl.reshape(b_q, [BLOCK_K, BLOCK_N])  # row k0 + j: weight k0 + j
                acc = _dot(b_x, (b_q - b_z[None, :]).to(tl.float32) * b_s[None, :], acc, DOT_F32)  # [BK, BN] weights
    if FP8:
        acc = acc * row_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=m_cols, other=0.0).to(tl.float32)[None, :]
    p_out = out + (i_s * M + rows[:, None]) * N + cols[None, :]
    tl.store(p_out, acc.to(out.dtype.element_ty), mask=m_rows[:, None] & m_cols[None, :])


@triton.jit
def _dequantize(w, scales, zeros, out, N, K, s_w, s_s, GROUP: tl.constexpr, BITS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N, K] = (q - zeros) * scales of an int4/int8 weight, computed in fp32 and rounded once to out's
    dtype: a [BLOCK_N, BLOCK_K] tile a program, each word's group looked up (any group of whole words)."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER_WORD
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)  # [W]
    m_cols = cols < N
    mask = m_cols[:, None] & (words * PER_WORD < K)[None, :]  # [BN, W]
    b_words = tl.load(w + cols[:, None] * s_w + words[None, :], mask=mask, other=0)  # [BN, W]
    groups = words * PER_WORD // GROUP  # [W] each word's group (GROUP % PER_WORD == 0)
    b_z = tl.load(zeros + cols[:, None] * s_s + groups[None, :], mask=mask, other=0).to(tl.float32)  # [BN, W]
    b_s = tl.load(scales + cols[:, None] * s_s + groups[None, :], mask=mask, other=0.0).to(tl.float32)  # [BN, W]
    o_j = tl.arange(0, PER_WORD)
    b_q = ((b_words[:, :, None] >> (o_j * BITS)[None, None, :]) & ((1 << BITS) - 1)).to(tl.float32)  # [BN, W, PW]
    b_w = (b_q - b_z[:, :, None]) * b_s[:, :, None]  # [BN, W, PW]
    ks = words[:, None] * PER_WORD + o_j[None, :]  # [W, PW]
    tl.store(out + cols[:, None, None].to(tl.int64) * K + ks[None, :, :], b_w.to(out.dtype.element_ty),
             mask=m_cols[:, None, None] & (ks < K)[None, :, :])


@triton.jit
def _dequantize_fp8(w, scales, out, N, K, s_w, s_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N, K] = fp8 weight * its row's scale, computed in fp32 and rounded once to out's dtype: a
    [BLOCK_N, BLOCK_K] tile a program."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    mask = (cols < N)[:, None] & (ks < K)[None, :]  # [BN, BK]
    b_q = tl.load(w + cols[:, None] * s_w + ks[None, :], mask=mask, other=0)  # [BN, BK] the fp8 values' bytes
    b_s = tl.load(scales + cols * s_s, mask=cols < N, other=0.0).to(tl.float32)  # [BN]
    b_w = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * b_s[:, None]  # [BN, BK]
    tl.store(out + cols[:, None].to(tl.int64) * K + ks[None, :], b_w.to(out.dtype.element_ty), mask=mask)


def dequantized(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, format: str, group: int,
                k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """quant.linear.dequantize's weight [N, K] in `dtype` (rounded once from fp32: the same bits where `dtype` or
    the scales are fp32 or bf16), in one pass over the packed words or fp8 bytes; None where it does not apply
    (an int4/int8 group of part of a word)."""
    if format != "fp8" and group % (32 // FORMATS[format]):
        return None
    n = weight.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    if format == "fp8":
        block_n, block_k = (16, 256) if weight.is_cuda else (64, 1024)
        _dequantize_fp8[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
            weight, scales, out, n, k, weight.stride(0), scales.stride(0), BLOCK_N=block_n, BLOCK_K=block_k)
        return out
    block_n, block_k = 4, 1024  # (the CPU's interpreter too: the kernel tests' launches compile for a GPU in
    # tests/test_kernels_compile.py, and a [64, 4096] tile took a minute a launch)
    _dequantize[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight, scales, zeros, out, n, k, weight.stride(0), scales.stride(0), GROUP=group, BITS=FORMATS[format],
        BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def tiling(n: int, k: int, format: str, group: int) -> tuple[int, int, int] | None:
    """(BLOCK_N, BLOCK_K, K splits) for a quantized [n, k] weight, from the weight alone (never the
    row count); None where no tile fits (a group that 32 does not divide)."""
    block_k = 128 if format == "fp8" else next((b for b in (128, 64, 32) if group % b == 0), None)
    if block_k is None or k % block_k:
        return None
    block_n = 64
    splits = max(1, min(8, 512 // triton.cdiv(n, block_n), k // (2 * block_k)))
    return block_n, block_k, splits


def project_quantized(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      bias: torch.Tensor | None, format: str, group: int, by_place: bool = False) -> torch.Tensor:
    """qlinear_reference's result through the tiles, each row the same bits for any row count (the
    reference where `tiling` finds none); `by_place`: a product per place in the words where a place's rows make
    one (16 or more), whose bits differ from the others'."""
    k = x.shape[-1]
    n = weight.shape[0]
    tiles = tiling(n, k, format, group)
    if tiles is None:
        return qlinear_reference(x, weight, scales, zeros, bias, format, group)
    block_n, block_k, _ = tiles
    by_place = by_place and format != "fp8" and block_k // (32 // FORMATS[format]) >= 16

    def tile(grid, x2, m, chunk, block_m, part, bias, fused_bias, pdl):
        _qproject[grid](x2, weight, scales, zeros if zeros is not None else scales, bias, part, m, n, k, x2.stride(0),
                        weight.stride(0), scales.stride(0), chunk, GROUP=group, BITS=FORMATS[format],
                        FP8=format == "fp8", HAS_BIAS=fused_bias, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        DOT_F32=x.dtype == torch.float32 or interpreted(), BY_PLACE=by_place, num_warps=4,
                        num_stages=3, **pdl)

    return in_tiles(x, n, bias, tiles, tile)


@torch.library.custom_op("specgraph::qlinear", mutates_args=())
def qlinear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            bias: torch.Tensor | None, format: str, group: int) -> torch.Tensor:
    """Same signature and result as qlinear_reference: the tiles for up to MAX_ROWS[format] rows (int8's by place
    to 8 rows: 1.4-2.2x faster there on an H100, run 143), the weight dequantized by `_dequantize` (the reference's
    bits) through cuBLAS for more."""
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS[format]:  # (the reference's dequantizing in torch's steps took 85 ms a depth-3 step at batch 8: run 128)
        weight_now = dequantized(weight, scales, zeros, format, group, x.shape[-1], x.dtype)
        if weight_now is None:
            return qlinear_reference(x, weight, scales, zeros, bias, format, group)
        return F.linear(x, weight_now, None if bias is None else bias.to(x.dtype))  # (as the tiles add it)
    return project_quantized(x, weight, scales, zeros, bias, format, group, by_place=format == "int8" and rows <= 8)


@qlinear.register_fake
def _(x, weight, scales, zeros, bias, format, group):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
