"""Triton KV move: one program per (layer, batch, kv head) copies its rows in order of i, so a
compaction (dst[i] <= src[i], dst ascending) never reads a row it already overwrote."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_move(cache, src, dst, D, S, K: tl.constexpr, BLOCK_K: tl.constexpr):
    base = cache + tl.program_id(0).to(tl.int64) * S * K
    cols = tl.arange(0, BLOCK_K)
    m = cols < K
    for i in range(D):
        row = tl.load(base + tl.load(src + i) * K + cols, mask=m)
        tl.store(base + tl.load(dst + i) * K + cols, row, mask=m)


@torch.library.custom_op("specgraph::kv_move", mutates_args=("cache",))
def kv_move(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Same signature and effect as kv_move_reference (cache contiguous [L, B, H, S, K])."""
    if not cache.is_contiguous():
        raise ValueError("kv_move needs a contiguous cache")
    layers, b, h, s, k = cache.shape
    if layers * b * h and src.numel():
        _kv_move[(layers * b * h,)](cache, src, dst, src.numel(), s, K=k, BLOCK_K=triton.next_power_of_2(k))
