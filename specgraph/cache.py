"""Static KV cache of one stage: a committed prefix, then the region a step writes.

Which slots are committed is the executor's to know (a device tensor, see runtime/serial.py):
the cache is storage. A step writes its tokens (a catch-up, draft-tree nodes, the tree being
verified) past the committed prefix; after verification, `move` gathers the accepted path's rows
to the end of the prefix, and everything past it is garbage that later steps overwrite.
"""

from __future__ import annotations

import torch

from specgraph.kernels.kv_move import kv_move_reference


class KVCache:
    """Keys and values of every attention layer of one stage: [layers, B, Hkv, S, K]."""

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.move_rows = kv_move_reference  # the select_kernels pass may swap in the Triton kernel

    @classmethod
    def wrap(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """A cache over existing key and value tensors [layers, B, Hkv, S, K] (an exported step's inputs)."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.capacity, cache.move_rows = k, v, k.shape[3], kv_move_reference
        return cache

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows src[i] -> dst[i] ([D] long) in order of i, for keys and values; needs
        dst[i] <= src[i] and dst ascending (compaction), so no row is read after it is overwritten."""
        self.move_rows(self.k, src, dst)
        self.move_rows(self.v, src, dst)
