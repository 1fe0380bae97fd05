"""Reference rotary embedding and cache write (elementwise in the inputs' dtype, as transformers' Llama)."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, K]; cos, sin [B, 1, T, K]."""
    return x * cos + rotate_half(x) * sin


def rope_write_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, K], k, v [B, T, Hkv, K] (views of the qkv projection); cos, sin [B, 1, T, K];
    keys, values [B, Hkv, S, K]: the layer's cache, where rotated k and v are written at slots [T].
    Returns rotated q [B, H, T, K]."""
    keys.index_copy_(2, slots, apply_rotary(k.transpose(1, 2), cos, sin))
    values.index_copy_(2, slots, v.transpose(1, 2))
    return apply_rotary(q.transpose(1, 2), cos, sin)
