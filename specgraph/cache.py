"""Static KV cache with a committed-prefix region and a tree region.

Slots [0, length) hold the committed prefix. A step writes its new tokens
(a catch-up chain, draft-tree nodes, or the tree being verified) at slots
[length, length + T) and attends over [0, length + T) under a mask. After
verification, `commit` gathers the accepted path's rows to the end of the
prefix; everything past it is garbage that the next step overwrites.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every attention layer of one stage: [layers, B, Hkv, S, K]."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0  # committed prefix length (slots)

    def write(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, K] at slots [slot, slot + T); return all keys/values up to there."""
        end = slot + k.shape[2]
        self.k[layer, :, :, slot:end] = k
        self.v[layer, :, :, slot:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]  # [B, Hkv, end, K]

    def commit(self, slots: torch.Tensor) -> None:
        """Append the rows at `slots` [A] (ascending, all >= length) to the committed prefix."""
        count = slots.numel()
        dest = slice(self.length, self.length + count)
        self.k[:, :, :, dest] = self.k[:, :, :, slots]
        self.v[:, :, :, dest] = self.v[:, :, :, slots]
        self.length += count

    def reset(self) -> None:
        self.length = 0
