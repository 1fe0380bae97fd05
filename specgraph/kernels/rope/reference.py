"""Reference rotary embedding and cache write (elementwise in the inputs' dtype, as transformers' Llama)."""

from __future__ import annotations

import torch

from specgraph.kernels.norm.reference import rmsnorm_reference


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, K]; cos, sin [B, 1, T, R]: the first R of each head's dims rotated, the rest as they are."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def rope_write_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                         q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                         eps: float = 0.0) -> torch.Tensor:
    """q [B, T, H, K], k, v [B, T, Hkv, K] (views of the qkv projection); cos, sin [B, 1, T, R], R <= K;
    keys, values [B, Hkv, S, K]: the layer's cache, where rotated k and v are written at slots [T];
    q_norm, k_norm [K]: per-head RMSNorm weights applied to q and k first (Qwen3, Qwen3.5), or None.
    Returns rotated q [B, H, T, K]."""
    if q_norm is not None:
        q, k = rmsnorm_reference(q, q_norm, eps), rmsnorm_reference(k, k_norm, eps)
    keys.index_copy_(2, slots, apply_rotary(k.transpose(1, 2), cos, sin))
    values.index_copy_(2, slots, v.transpose(1, 2))
    return apply_rotary(q.transpose(1, 2), cos, sin)
