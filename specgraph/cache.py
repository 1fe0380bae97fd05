"""Static KV cache of one stage: a committed prefix, then the region a step writes.

Which slots are committed is the executor's to know (a device tensor, see runtime/sequence.py):
the cache is storage. A step writes its tokens (a catch-up, draft-tree nodes, the tree being
verified) past the committed prefix; after verification, `commit` moves the accepted path's rows
to the end of the prefix, and everything past it is garbage that later steps overwrite.

The invariant, with L tokens committed (tests/test_kv_invariant.py checks it against
recomputation from scratch over random trees and verdicts):
  - slots [0, L - 1) hold the K/V of committed[:L - 1], each at its own position, in every stage;
  - a verifier writes a tree from slot L - 1 (its root, committed[L - 1]) and `commit` leaves the
    accepted path at L - 1 + depth;
  - a drafter that keeps growing one tree across steps (growing.py) holds, at slot L - 1 + j, the
    K/V of the tree node it fed at region offset j (offset 0: the root), in feed order, so that a
    re-root is one compaction: the accepted path to the prefix, the surviving subtree after it.
  - a pipeline stage (runtime/pipeline.py) rolled back to L' committed tokens keeps slots
    [0, min(fed, L' - 1)) as they are, `fed` being the committed tokens whose K/V it holds: a
    rollback recomputes nothing; besides the root, the committed tokens not fed yet are those
    adopted from the stages above since the stage last stepped (at most one from each), fed with
    its next step.
A hybrid model's cache also holds each gated-DeltaNet layer's recurrent state, which a forward
reads but does not change: the forward leaves its tokens' factors, and `commit` (or, for a
drafter, `fold`) folds the accepted path's into the state. A forward sees the state and its own
tokens only, not an earlier forward's uncommitted ones (`recurrent`): a step must be one forward.
"""

from __future__ import annotations

import torch

from specgraph.kernels import Kernels


class KVCache:
    """Keys and values of every attention layer of one stage: [layers, B, Hkv, S, K]."""

    TENSORS = ("k", "v")  # the storage, in the order of `tensors()` and `wrap`
    recurrent = False  # whether a forward sees only committed state and its own tokens (see the module doc)

    def __init__(self, layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, kernels: Kernels = Kernels()):
        """`kernels`: the stage's choice of kernels, whose kv_move (and a hybrid's gated_delta_commit) run here."""
        shape = (layers, batch, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.max_step_tokens = capacity  # tokens one forward may write before a commit
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

    def reset(self) -> None:
        """Start a new sequence: nothing to clear, as masks hide every slot past the committed prefix."""

    def keep(self, count: int) -> None:
        """Keep all `count` tokens of the last forward, a chain written at its own committed slots (a
        prompt chunk): their K/V are already in place."""

    def commit(self, path: torch.Tensor, start: torch.Tensor | int) -> None:
        """Keep a step's accepted path: path [P] long (nodes of the step written from slot `start`,
        root first, -1 padded) moves to slots start + depth."""
        if path.numel() == 1:  # the root alone (an autoregressive step): already at `start`
            return
        dst = start + torch.arange(path.numel(), device=path.device)
        self.move(torch.where(path >= 0, start + path, dst), dst)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows src[i] -> dst[i] ([D] long) in order of i, for keys and values; needs
        dst[i] <= src[i] and dst ascending (compaction), so no row is read after it is overwritten."""
        self.kernels.kv_move(self.k, src, dst)
        self.kernels.kv_move(self.v, src, dst)


class HybridCache(KVCache):
    """A KVCache for the attention layers, plus, for each of the L gated-DeltaNet layers, its state
    [L, B, H, dk, dv] (fp32) and last conv_kernel - 1 inputs [L, B, K - 1, C], committed; and the
    factors of the last forward's tokens (at most `step_tokens`), which `commit` folds in."""

    TENSORS = KVCache.TENSORS + ("state", "conv", "step_k", "step_u", "step_decay", "step_inputs")
    recurrent = True

    def __init__(self, attention_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, kernels: Kernels = Kernels(), *,
                 linear_layers: int, heads: int, key_dim: int, value_dim: int, conv_channels: int, conv_kernel: int,
                 step_tokens: int):
        super().__init__(attention_layers, batch, kv_heads, head_dim, capacity, dtype, device, kernels)
        lb, f32 = (linear_layers, batch), dict(dtype=torch.float32, device=device)
        self.state = torch.zeros(*lb, heads, key_dim, value_dim, **f32)
        self.conv = torch.zeros(*lb, conv_kernel - 1, conv_channels, dtype=dtype, device=device)
        self.step_k = torch.zeros(*lb, step_tokens, heads, key_dim, **f32)
        self.step_u = torch.zeros(*lb, step_tokens, heads, value_dim, **f32)
        self.step_decay = torch.zeros(*lb, step_tokens, heads, **f32)
        self.step_inputs = torch.zeros(*lb, step_tokens, conv_channels, dtype=dtype, device=device)
        self.max_step_tokens = step_tokens

    def reset(self) -> None:
        self.state.zero_()
        self.conv.zero_()

    def keep(self, count: int) -> None:
        self.fold(torch.arange(count, device=self.state.device))

    def commit(self, path: torch.Tensor, start: torch.Tensor | int) -> None:
        super().commit(path, start)
        self.fold(path)

    def fold(self, path: torch.Tensor) -> None:
        """Advance every DeltaNet state and conv window along `path` ([P] long: rows of the last
        forward, oldest first, -1 padded; all -1: no change)."""
        self.kernels.gated_delta_commit(self.state, self.conv, self.step_k, self.step_u, self.step_decay,
                                        self.step_inputs, path)
