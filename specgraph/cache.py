"""Static KV cache with a committed-prefix region and a tree region.

Slots [0, length) hold the committed prefix. A step writes its new tokens
(a catch-up chain, draft-tree nodes, or the tree being verified) at slots
[length, length + T) and attends over all slots under a mask, so that every
step of a given T has the same shapes (and can be captured as a CUDA graph).
After verification, `commit` gathers the accepted path's rows to the end of
the prefix; everything past it is garbage that the next step overwrites.
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

    @classmethod
    def wrap(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """A cache over existing key and value tensors [layers, B, Hkv, S, K] (an exported step's inputs)."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.capacity, cache.length = k, v, k.shape[3], 0
        return cache

    def commit(self, slots: torch.Tensor) -> None:
        """Append the rows at `slots` [A] (ascending, all >= length) to the committed prefix."""
        count = slots.numel()
        dest = slice(self.length, self.length + count)
        self.k[:, :, :, dest] = self.k[:, :, :, slots]
        self.v[:, :, :, dest] = self.v[:, :, :, slots]
        self.length += count

    def reset(self) -> None:
        self.length = 0
