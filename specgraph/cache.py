"""The KV cache of one stage: a pool of blocks shared by the requests it holds (specgraph/layout.py).

Which virtual slots of a request are committed is the executor's to know (a device tensor): the
cache is storage. A step writes its tokens (a catch-up, draft-tree nodes, the tree being verified)
past a request's committed prefix; after verification, `commit` moves the accepted path's rows to
the end of the prefix, and everything past it is garbage that later steps overwrite.

The invariant, per request, with L tokens committed (tests/test_kv_invariant.py checks it
against recomputation from scratch over random trees and verdicts):
  - virtual slots [0, L - 1) hold the K/V of committed[:L - 1], each at its own position, in every stage;
  - a verifier writes a tree from virtual slot L - 1 (its root, committed[L - 1]) and `commit`
    leaves the accepted path at L - 1 + depth;
  - a drafter that keeps growing one tree across steps (growing.py) holds, at slot L - 1 + j, the
    K/V of the tree node it fed at region offset j (offset 0: the root), in feed order, so that a
    re-root is one compaction: the accepted path to the prefix, the surviving subtree after it.
  - a pipeline stage (runtime/pipeline.py) rolled back to L' committed tokens keeps slots
    [0, min(fed, L' - 1)) as they are, `fed` being the committed tokens whose K/V it holds: a
    rollback recomputes nothing; besides the root, the committed tokens not fed yet are those
    adopted from the stages above since the stage last stepped (at most one from each), fed with
    its next step.
A hybrid model's cache also holds, per request slot, each gated-DeltaNet layer's recurrent state,
which a forward reads but does not change: the forward leaves its tokens' factors, and `commit`
(or, for a drafter, `fold`) folds the accepted path's into the state. A forward sees the state and
its own tokens only, not an earlier forward's uncommitted ones (`recurrent`): a step must be one
forward.

Moves and folds take the block table and, per request, its row: rows [R] and virtual slots [R, D].
"""

from __future__ import annotations

import torch

from specgraph.kernels import Kernels
from specgraph.layout import physical


class KVCache:
    """Keys and values of every attention layer of one stage: [layers, 1, Hkv, blocks * block_size, K]."""

    TENSORS = ("k", "v")  # the storage, in the order of `tensors()` and `wrap`
    recurrent = False  # whether a forward sees only committed state and its own tokens (see the module doc)

    def __init__(self, layers: int, kv_heads: int, head_dim: int, blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, kernels: Kernels = Kernels()):
        """`kernels`: the stage's choice of kernels, whose kv_move (and a hybrid's gated_delta_commit) run here."""
        shape = (layers, 1, kv_heads, blocks * block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.blocks, self.block_size = blocks, block_size
        self.max_step_tokens = blocks * block_size  # tokens one forward of a request may write before a commit
        self.kernels = kernels

    def tensors(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """The storage tensors (named by TENSORS), each as its layers' views: what an exported step
        program takes as inputs. One input per layer: AOTInductor writes a forward's K/V into an
        input of its own in place, but into one layer of a whole [layers, ...] input by copying that
        whole input once per layer (issue 32: the tree recipe's target, 8 layers, took 29 ms for a
        one-token step on the CPU, against 2.6 ms per layer input and 5 ms eager)."""
        return tuple(getattr(self, name).unbind(0) for name in self.TENSORS)

    @classmethod
    def wrap(cls, *tensors: tuple[torch.Tensor, ...]) -> KVCache:
        """A cache over existing storage given as `tensors()` gives it (an exported step's inputs):
        `k[i]` is layer i's keys, as in a cache of whole tensors. It holds the storage only, all
        that a model's forward reads."""
        cache = cls.__new__(cls)
        for name, layers in zip(cls.TENSORS, tensors, strict=True):
            setattr(cache, name, layers)
        return cache

    def reset(self, rows: torch.Tensor) -> None:
        """Start new requests in table rows `rows` [R]: nothing to clear, as masks hide every slot
        past a request's committed prefix."""

    def keep(self, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep the first counts[r] tokens of segment r of the last forward (request slot rows[r]),
        chains written at their own committed slots (prompt chunks): their K/V are already in place."""

    def commit(self, table: torch.Tensor, rows: torch.Tensor, paths: torch.Tensor, starts: torch.Tensor) -> None:
        """Keep each request's accepted path: paths [R, P] long (nodes of its last tree, written from
        virtual slot starts[r] in node order, root first, -1 padded) move to starts[r] + depth."""
        if paths.shape[1] == 1:  # the roots alone (an autoregressive step): already in place
            return
        dst = starts[:, None] + torch.arange(paths.shape[1], device=paths.device)  # [R, P]
        self.move(table, rows, torch.where(paths >= 0, starts[:, None] + paths, dst), dst)

    def move(self, table: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy each request's virtual slots src[r, i] -> dst[r, i] ([R, D] long) in order of i, for
        keys and values; needs dst[r, i] <= src[r, i] and dst[r] ascending (a compaction), so no
        row is read after it is overwritten."""
        src, dst = (physical(table, self.block_size, rows[:, None], x).flatten() for x in (src, dst))
        self.kernels.kv_move(self.k, src, dst)
        self.kernels.kv_move(self.v, src, dst)


class HybridCache(KVCache):
    """A KVCache for the attention layers, plus, for each of the L gated-DeltaNet layers and each of
    the N request slots (table rows), its state [L, N, H, dk, dv] (fp32) and last conv_kernel - 1
    inputs [L, N, K - 1, C], committed; and the factors of the last forward's tokens (at most
    `step_tokens` per segment, in row b for segment b), which `commit` folds in."""

    TENSORS = KVCache.TENSORS + ("state", "conv", "step_k", "step_u", "step_decay", "step_inputs")
    recurrent = True

    def __init__(self, attention_layers: int, kv_heads: int, head_dim: int, blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str, kernels: Kernels = Kernels(), *,
                 requests: int, linear_layers: int, heads: int, key_dim: int, value_dim: int, conv_channels: int,
                 conv_kernel: int, step_tokens: int):
        super().__init__(attention_layers, kv_heads, head_dim, blocks, block_size, dtype, device, kernels)
        f32 = dict(dtype=torch.float32, device=device)
        slots = (linear_layers, requests)
        self.state = torch.zeros(*slots, heads, key_dim, value_dim, **f32)
        self.conv = torch.zeros(*slots, conv_kernel - 1, conv_channels, dtype=dtype, device=device)
        self.step_k = torch.zeros(*slots, step_tokens, heads, key_dim, **f32)
        self.step_u = torch.zeros(*slots, step_tokens, heads, value_dim, **f32)
        self.step_decay = torch.zeros(*slots, step_tokens, heads, **f32)
        self.step_inputs = torch.zeros(*slots, step_tokens, conv_channels, dtype=dtype, device=device)
        self.max_step_tokens = step_tokens

    def reset(self, rows: torch.Tensor) -> None:
        self.state.index_fill_(1, rows, 0.0)
        self.conv.index_fill_(1, rows, 0.0)

    def keep(self, rows: torch.Tensor, counts: torch.Tensor) -> None:
        index = torch.arange(self.max_step_tokens, device=counts.device)
        self.fold(rows, torch.where(index[None, :] < counts[:, None], index, -1))  # [R, S]: each chunk whole

    def commit(self, table: torch.Tensor, rows: torch.Tensor, paths: torch.Tensor, starts: torch.Tensor) -> None:
        super().commit(table, rows, paths, starts)
        self.fold(rows, paths)

    def fold(self, rows: torch.Tensor, paths: torch.Tensor) -> None:
        """Advance the DeltaNet state and conv window of request slot rows[r] along paths[r] ([R, P]
        long: rows of segment r of the last forward, oldest first, -1 padded; all -1: no change)."""
        self.kernels.gated_delta_commit(self.state, self.conv, self.step_k, self.step_u, self.step_decay,
                                        self.step_inputs, paths, rows)
