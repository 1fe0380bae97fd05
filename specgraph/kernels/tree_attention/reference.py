"""Reference tree attention: build the [T, prefix + T] mask and call SDPA.

Memory traffic: reads q [B, H, T, K] and the K/V rows [0, prefix) and [tree_start, tree_start + T)
of every kv head once per query head group, and materialises a [T, prefix + T] mask (the fast path
does not: it reads one int64 ancestor word per query).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pack_ancestors(ancestors: torch.Tensor) -> torch.Tensor:
    """ancestors [T, T] bool (T <= 64) -> [T] int64 with bit j set where node j is i or an ancestor of i."""
    t = ancestors.shape[0]
    if t > 64:
        raise ValueError(f"tree attention packs ancestors into 64-bit words; got {t} nodes")
    bits = torch.ones(t, dtype=torch.int64, device=ancestors.device) << torch.arange(t, device=ancestors.device)
    return (ancestors.to(torch.int64) * bits).sum(-1)


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_len: int,
                             tree_start: int, ancestor_bits: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [B, H, T, K]: the tree's queries; k_cache, v_cache [B, Hkv, S, K]; the prefix is slots
    [0, prefix_len), the tree's keys are at [tree_start, tree_start + T); ancestor_bits [T] int64
    (see pack_ancestors). Returns [B, H, T, K] in q's dtype."""
    t = q.shape[2]
    bits = torch.arange(t, device=q.device)
    tree_mask = ((ancestor_bits[:, None] >> bits[None, :]) & 1).bool()  # [T, T]
    keys = torch.cat([k_cache[:, :, :prefix_len], k_cache[:, :, tree_start:tree_start + t]], dim=2)
    values = torch.cat([v_cache[:, :, :prefix_len], v_cache[:, :, tree_start:tree_start + t]], dim=2)
    mask = torch.cat([torch.ones(t, prefix_len, dtype=torch.bool, device=q.device), tree_mask], dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k_cache.shape[1])
