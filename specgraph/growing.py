"""Parallel tree generation (SwiftSpec): the drafter of asynchronous executors keeps one tree that
outlives each step. It grows by maximum-likelihood expansion (under the sampling rule, by the
perturbed scores of draft.perturbed_children, keyed by each node's absolute position, which a
re-root does not change) while the target verifies what was sent, and each verdict re-roots it at the last accepted token: if the bonus token is already a
(grown) node, the subtree under it survives — its K/V kept and compacted in place, nothing
recomputed — and the next tree can be sent at once; otherwise the drafter restarts from the bonus.

The tree lives in a pool of P nodes on the device (root at index 0, parents before children):
token, parent, depth and score (cumulative draft log-probability from the root) per node, an
ancestor matrix, a status (unused, leaf, expanded) and, for expanded nodes, the offset of its K/V
in the draft cache's tree region. Every operation is a fixed sequence of device operations
(capturable as a CUDA graph); the host reads once per verdict (survived? stop? consistent?).

Draft-cache invariant (L tokens committed, the root being committed[L - 1]): slots [0, L - 1)
hold the K/V of committed[:L - 1]; slot L - 1 + j holds the K/V of the node fed at region offset
j < fed_count (offset 0 is the root; an offset may hold nothing, where a step had fewer leaves to
feed than it feeds). Offsets follow feed order, which puts every node's ancestors before it, so a
re-root is one compaction (destination <= source, in order): the accepted path's K/V land at
L - 1 + depth (the new committed prefix), the surviving subtree's right after them (the new
region, the new root at offset 0).
"""

from __future__ import annotations

import torch

from specgraph.draft import Requests, best_children, catch_up, perturbed_children
from specgraph.runtime.stage import Stage
from specgraph.sampling import SamplingRows
from specgraph.tree import CATCH_UP, Growth

UNUSED, LEAF, EXPANDED = 0, 1, 2


class GrowingDrafter:
    def __init__(self, stage: Stage, growth: Growth, sampling: SamplingRows | None = None):
        """`sampling`: the request's settings and seed where the sampling rule verifies (children
        and scores are then the perturbed ones: draft.perturbed_children), else None (the most likely)."""
        self.stage, self.growth, self.sampling = stage, growth, sampling
        p, f, device = growth.pool, growth.region, stage.device
        self.tokens = torch.zeros(p, dtype=torch.long, device=device)  # [P]
        self.parents = torch.full((p,), -1, dtype=torch.long, device=device)  # [P]
        self.depths = torch.zeros(p, dtype=torch.long, device=device)  # [P]
        self.scores = torch.zeros(p, dtype=torch.float64, device=device)  # [P] (fp64: exact sums)
        self.lineage = torch.zeros(p, p, dtype=torch.bool, device=device)  # [P, P] row i: i and its ancestors
        self.status = torch.zeros(p, dtype=torch.long, device=device)  # [P] UNUSED, LEAF or EXPANDED
        self.fed = torch.full((p,), -1, dtype=torch.long, device=device)  # [P] region offset of its K/V, -1
        self._fed_node = torch.full((f + 1,), -1, dtype=torch.long, device=device)  # [F + 1]: offset F a dummy
        self.fed_node = self._fed_node[:f]  # [F] node fed at each region offset, -1
        self.size = torch.zeros((), dtype=torch.long, device=device)  # nodes made (the next free index)
        self.fed_count = torch.zeros((), dtype=torch.long, device=device)
        self.sent = torch.zeros(growth.nodes + 1, dtype=torch.long, device=device)  # [N + 1] pool index of each sent node
        self._index = torch.arange(p, device=device)
        self._row = torch.zeros(1, dtype=torch.long, device=device)  # the request's row of the table

    def restart(self, committed: torch.Tensor, length: torch.Tensor, width: int, feeds: int = CATCH_UP) -> None:
        """A fresh tree rooted at the last of the `length` committed tokens: the catch-up feeds the last
        `feeds` of them (the root at region offset 0), then the root's children and `first` - 1 expansion steps."""
        logits = catch_up(self.stage, Requests.one(committed, length, feeds), width)  # [1, V]
        self.status.zero_()
        self.parents.fill_(-1)
        self.fed.fill_(-1)
        self._fed_node.fill_(-1)
        self.lineage.zero_()
        self.tokens[:1] = committed.index_select(0, length.reshape(1) - 1)
        # (fill_, not `x[:1] = 0`: that copies a CPU tensor in, which a CUDA graph cannot hold)
        self.depths[:1].fill_(0)
        self.scores[:1].fill_(0)
        self.status[:1].fill_(EXPANDED)
        self.fed[:1].fill_(0)
        self.fed_node[:1].fill_(0)
        self.lineage[0, 0].fill_(True)
        self.size.fill_(1)
        self.fed_count.fill_(1)
        self._children(torch.zeros(1, dtype=torch.long, device=self.stage.device), torch.ones(1, dtype=torch.bool,
                                                                                              device=self.stage.device), logits, length)
        for _ in range(self.growth.first - 1):
            self.expand(length, width)

    def expand(self, length: torch.Tensor, width: int) -> None:
        """One expansion step: feed the B leaves of highest score (ties: the earlier made) at the next
        region offsets and give each its W most likely children. Past the leaves there are (a tree
        with fewer than B), picks are marked invalid: fed nowhere visible, their children unused.
        The pool and region hold the `steps` expansions a re-root is followed by (Growth)."""
        b = self.growth.leaves
        device = self.stage.device
        candidates = torch.where(self.status == LEAF, self.scores, float("-inf"))  # [P]
        pick = candidates.sort(descending=True, stable=True).indices[:b]  # [B]
        valid = candidates.index_select(0, pick) > float("-inf")  # [B]
        offsets = self.fed_count + torch.arange(b, device=device)  # [B]
        self.fed.index_put_((pick,), torch.where(valid, offsets, self.fed.index_select(0, pick)))
        self.fed_node.index_put_((offsets,), torch.where(valid, pick, -1))
        nodes_at = self.fed_node.clamp(min=0)  # [F]
        visible = self.lineage.index_select(0, pick).index_select(1, nodes_at) & (self.fed_node >= 0)  # [B, F]
        start = length - 1
        logits = self.stage.forward_one(self.tokens.index_select(0, pick), start + self.depths.index_select(0, pick),
                                        start, offsets, visible, width)  # [B, V]
        self.status.index_put_((pick,), torch.where(valid, EXPANDED, self.status.index_select(0, pick)))
        self.fed_count += b
        self._children(pick, valid, logits, length)

    def _children(self, parents: torch.Tensor, valid: torch.Tensor, logits: torch.Tensor, length: torch.Tensor) -> None:
        """Make the W most likely children of each of `parents` [E] (logits [E, V]; `length` [] tokens
        committed, the root the last) at the next free indices (the sampling rule: the W best by perturbed score)."""
        w = self.growth.width
        if self.sampling is None:
            tokens, gained = best_children(logits, w)  # [E, W]
        else:  # (a child of a node at depth d takes sequence index length + d)
            positions = length + self.depths.index_select(0, parents)  # [E]
            tokens, gained = perturbed_children(logits[None], w, self.sampling, positions[None],
                                                self.stage.kernels.perturbed_top)
            tokens, gained = tokens[0], gained[0]
        new = self.size + torch.arange(parents.numel() * w, device=self.stage.device)  # [E W]
        parent = parents.repeat_interleave(w)  # [E W]
        self.tokens.index_put_((new,), tokens.flatten())
        self.parents.index_put_((new,), parent)
        self.depths.index_put_((new,), self.depths.index_select(0, parent) + 1)
        self.scores.index_put_((new,), self.scores.index_select(0, parent) + gained.flatten().double())
        self.status.index_put_((new,), torch.where(valid.repeat_interleave(w), LEAF, UNUSED))
        self.lineage.index_put_((new,), self.lineage.index_select(0, parent))
        self.lineage.index_put_((new, new), torch.ones_like(new, dtype=torch.bool))
        self.size += new.numel()

    def select(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree to send: the root and the N most likely nodes of depth at most D (ancestor-closed:
        children never outscore parents, and ties keep parents first), in pool order -> tokens,
        parents [N + 1]. Should fewer than N nodes qualify, the rest repeat the root's best child (a
        sibling that carries its token is never accepted before it); `self.sent` maps the tree's
        nodes back to the pool."""
        n, p = self.growth.nodes, self.growth.pool
        device = self.stage.device
        eligible = (self.status != UNUSED) & (self._index > 0) & (self.depths <= self.growth.depth)
        candidates = torch.where(eligible, self.scores, float("-inf"))  # [P]
        order = candidates.sort(descending=True, stable=True).indices[:n]  # [N]
        valid = candidates.index_select(0, order) > float("-inf")
        best_child = order[:1]  # the most likely node is a child of the root
        keys = torch.where(valid, order, p + torch.arange(n, device=device)).sort().values  # [N] pool order, padding last
        padding = keys >= p
        nodes = torch.where(padding, best_child, keys)  # [N]
        self.sent.copy_(torch.cat([torch.zeros(1, dtype=torch.long, device=device), nodes]))
        position = torch.full((p + 1,), -1, dtype=torch.long, device=device)  # pool index -> tree node (p: padding's)
        position[0].fill_(0)
        position.index_put_((torch.where(padding, p, nodes),), torch.arange(1, n + 1, device=device))
        parents = torch.where(padding, 0, position.index_select(0, self.parents.index_select(0, nodes).clamp(min=0)))
        return self.tokens.index_select(0, self.sent), torch.cat([torch.full((1,), -1, device=device), parents])

    def reroot(self, path: torch.Tensor, count: torch.Tensor, new: torch.Tensor,
               length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply a verdict on the sent tree (path [D + 1] of its nodes, count [] new tokens, new [D + 1]
        the new tokens) committed after `length` [] tokens: move the accepted path's K/V into the
        prefix and, where the bonus is an expanded child of the last accepted node, keep its subtree
        (the `keep` most likely of it) as the tree, compacted. Returns whether it survived [] bool
        (if not, `restart` the tree) and whether the bonus was a node at all [] bool (grown or not)."""
        p, device = self.growth.pool, self.stage.device
        on_path = torch.where(path >= 0, self.sent.index_select(0, path.clamp(min=0)), p)  # [D + 1] pool index, p: none
        last = on_path.index_select(0, count.reshape(1) - 1)  # [1]
        bonus = new.index_select(0, count.reshape(1) - 1)  # [1]
        child = (self.parents == last) & (self.tokens == bonus) & (self.status != UNUSED) & (self._index > 0)  # [P]
        b = child.long().argmax()
        survived = child.any() & (self.status.index_select(0, b.reshape(1))[0] == EXPANDED)
        below = self.lineage.index_select(1, b.reshape(1))[:, 0] & survived  # [P] b's subtree
        ranked = torch.where(below, self.scores, float("-inf")).sort(descending=True, stable=True)
        kept = torch.zeros(p + 1, dtype=torch.bool, device=device)
        kept.index_put_((ranked.indices[: self.growth.keep],), ranked.values[: self.growth.keep] > float("-inf"))
        kept = kept[:p]
        path_mask = torch.zeros(p + 1, dtype=torch.bool, device=device)
        path_mask.index_put_((on_path,), torch.ones_like(on_path, dtype=torch.bool))
        moving = (path_mask[:p] | kept) & (self.fed >= 0)  # [P]
        self._compact_pool(kept, b, count, self._compact_kv(moving, length))
        return survived, child.any()

    def _compact_kv(self, moving: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Move the K/V of `moving` nodes [P] to consecutive region offsets in feed order (a
        compaction) -> each old offset's new one [F] (-1: not moved)."""
        f, device = self.growth.region, self.stage.device
        unmoved = torch.full((f,), f, dtype=torch.long, device=device)  # (a pool may hold fewer nodes than F)
        src = torch.cat([torch.where(moving, self.fed, f), unmoved]).sort().values[:f]  # [F] offsets, unmoved last
        moved = src < f
        offsets = torch.arange(f, device=device)
        start = length - 1
        stage = self.stage
        stage.cache.move(stage.table, self._row, (start + torch.where(moved, src, offsets))[None], (start + offsets)[None])
        rank = torch.full((f + 1,), -1, dtype=torch.long, device=device)  # old offset -> new (f: dummy)
        rank.index_put_((torch.where(moved, src, f),), offsets)
        return rank[:f]

    def _compact_pool(self, kept: torch.Tensor, b: torch.Tensor, count: torch.Tensor, moved_to: torch.Tensor) -> None:
        """Keep `kept` nodes [P] (b's subtree, b first), in pool order, b the new root at depth 0 and score 0."""
        p, f, device = self.growth.pool, self.growth.region, self.stage.device
        old = torch.where(kept, self._index, p + self._index).sort().indices  # [P] new index -> old
        live = self._index < kept.sum()  # [P] new index in use
        renumber = torch.full((p,), -1, dtype=torch.long, device=device)
        renumber.index_put_((old,), torch.where(live, self._index, -1))  # old index -> new, -1 dropped
        root_depth, root_score = self.depths.index_select(0, b.reshape(1)), self.scores.index_select(0, b.reshape(1))
        parents = self.parents.index_select(0, old)
        self.parents.copy_(torch.where(live & (old != b), renumber.index_select(0, parents.clamp(min=0)), -1))
        self.tokens.copy_(self.tokens.index_select(0, old))
        self.depths.copy_(self.depths.index_select(0, old) - root_depth)
        self.scores.copy_(self.scores.index_select(0, old) - root_score)
        self.lineage.copy_(self.lineage.index_select(0, old).index_select(1, old) & live[:, None] & live[None, :])
        self.status.copy_(torch.where(live, self.status.index_select(0, old), UNUSED))
        fed = self.fed.index_select(0, old)  # [P] old offsets of the new nodes
        new_offset = moved_to.index_select(0, fed.clamp(min=0)) - count  # the path's fed nodes went to the prefix
        self.fed.copy_(torch.where(live & (fed >= 0), new_offset, -1))
        self._fed_node.fill_(-1)
        self._fed_node.index_put_((torch.where(self.fed >= 0, self.fed, f),), self._index)
        self.size.copy_(kept.sum())
        self.fed_count.copy_((self.fed >= 0).sum())
