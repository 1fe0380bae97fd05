"""Drafting: grow one draft tree per step on a drafting stage.

The root (last committed token) is fed by the stage's catch-up. Every node that gets children
is fed to the draft model once, in batches (one per depth for static trees, one per expansion
step for dynamic trees), at draft-cache slots past the committed prefix, under a mask that shows
it the prefix and its own fed ancestors. After verification, `commit` keeps the draft K/V of the
accepted nodes that were fed; the next catch-up feeds the rest.

Chain and static trees are grown on the device with no host reads: their shape is known, so the
feed batches, masks, positions and child slots are constants planned once (`_StaticPlan`).
Dynamic trees choose what to expand from the scores, on the host.

Children are chosen per node either deterministically (top-k of the draft logits: greedy and
typical rules, and dynamic trees) or, for the sampling rule on chain and static trees, drawn
without replacement from the draft distribution q. `Tree.proposals` records the distribution
each node was drawn from, which is what lossless verification needs: q minus the earlier
siblings for draws, the node's own one-hot for deterministic choices.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specgraph.recipe import DynamicTree, SamplingSpec
from specgraph.runtime.stage import Stage
from specgraph.sampling import draw_without_replacement, probs_from_logits
from specgraph.tree import Tree, TreeStructure, TreeTopology, prefix_tree_mask


class _Growth:
    """A dynamic tree under construction on the host, with the draft-cache slot of each fed node."""

    def __init__(self, stage: Stage, root: int):
        self.stage = stage
        self.prefix = stage.cache.length  # the root is the last prefix slot
        self.tokens, self.parents, self.depths = [root], [-1], [0]
        self.proposals: list[torch.Tensor | None] = [None]
        self.fed: list[int] = []  # nodes in feed order; node fed[i] sits at slot prefix + i
        self.slot = {0: self.prefix - 1}

    def add(self, token: int, parent: int, proposal: torch.Tensor | None) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.proposals.append(proposal)
        return len(self.tokens) - 1

    def lineage(self, node: int) -> list[int]:
        """node and its ancestors, root excluded."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out

    def feed(self, nodes: list[int]) -> torch.Tensor:
        """Run the draft model on `nodes` (each with its fed ancestors) -> logits [T, V]."""
        device = self.stage.device
        first = self.prefix + len(self.fed)
        for node in nodes:
            self.slot[node] = self.prefix + len(self.fed)
            self.fed.append(node)
        visible = torch.zeros(len(nodes), len(self.fed), dtype=torch.bool)  # [T, fed so far]
        for row, node in enumerate(nodes):
            visible[row, [self.slot[a] - self.prefix for a in self.lineage(node)]] = True
        mask = prefix_tree_mask(self.prefix, visible.to(device))  # [T, prefix + fed]
        tokens = torch.tensor([self.tokens[n] for n in nodes], device=device)
        positions = torch.tensor([self.prefix - 1 + self.depths[n] for n in nodes], device=device)
        return self.stage.forward(tokens, positions, first, mask)

    def tree(self, keep: list[int]) -> tuple[Tree, list[int]]:
        """The tree of the `keep` nodes (ascending, ancestor-closed, root included) and their slots (-1: not fed)."""
        index = {old: new for new, old in enumerate(keep)}
        device = self.stage.device
        tokens = torch.tensor([self.tokens[n] for n in keep], device=device)
        parents = torch.tensor([index.get(self.parents[n], -1) for n in keep], device=device)
        proposals = None
        if self.proposals[-1] is not None:
            vocab = self.proposals[-1].numel()
            proposals = torch.stack([torch.zeros(vocab, device=device)] + [self.proposals[n] for n in keep[1:]])
        structure = TreeStructure.of([index.get(self.parents[n], -1) for n in keep], device)
        return Tree(tokens, parents, proposals, structure), [self.slot.get(n, -1) for n in keep]


class _Level(NamedTuple):
    """One depth of a static tree's growth (device tensors)."""

    expanding: torch.Tensor  # [E] the nodes of this depth that have children, in feed order
    visible: torch.Tensor  # [E, fed so far] bool: which fed nodes (this depth's included) each one sees
    width: int  # most children of one of them
    rows: torch.Tensor  # [M] for each child of this depth's nodes: the row of its parent in `expanding`
    ranks: torch.Tensor  # [M] its rank among its siblings
    kids: torch.Tensor  # [M] its node index


class _StaticPlan:
    """The constants of growing one static topology on a device. Level d feeds the nodes at depth d
    that have children (the root, at depth 0, comes from the catch-up) and fills their children."""

    def __init__(self, topo: TreeTopology, device: torch.device):
        self.structure = TreeStructure.of(topo.parents, device)
        self.parents = torch.tensor(topo.parents, device=device)
        self.fed_at: dict[int, int] = {}  # node -> offset of its draft-cache slot past the prefix
        self.levels: list[_Level] = []
        for depth in range(topo.max_depth):
            expanding = topo.expanding(depth)
            if depth > 0:
                for u in expanding:
                    self.fed_at[u] = len(self.fed_at)
            visible = torch.zeros(len(expanding), len(self.fed_at), dtype=torch.bool)
            for row, u in enumerate(expanding):
                while u > 0:  # u and its ancestors below the root (which is in the prefix)
                    visible[row, self.fed_at[u]] = True
                    u = topo.parents[u]
            rows, ranks, kids = zip(*[(row, rank, kid) for row, u in enumerate(expanding)
                                      for rank, kid in enumerate(topo.children(u))])
            longs = [torch.tensor(x, dtype=torch.long, device=device) for x in (expanding, rows, ranks, kids)]
            self.levels.append(_Level(longs[0], visible.to(device), max(ranks) + 1, *longs[1:]))


class Drafter:
    def __init__(self, stage: Stage, plan: TreeTopology | DynamicTree, rule: str, sampling: SamplingSpec):
        self.stage, self.plan, self.rule, self.sampling = stage, plan, rule, sampling
        self._static = None if isinstance(plan, DynamicTree) else _StaticPlan(plan, stage.device)
        self._slots: list[int] = []  # draft-cache slot of each node of the last tree, -1 if not fed

    @torch.inference_mode()
    def draft(self, committed: torch.Tensor, generator: torch.Generator) -> Tree:
        """committed [L] -> a draft tree rooted at committed[-1]."""
        root_logits = self.stage.catch_up(committed)
        if self._static is not None:
            prefix = self.stage.cache.length
            self._slots = [prefix + self._static.fed_at[n] if n in self._static.fed_at else -1
                           for n in range(len(self.plan.parents))]
            return self._grow_static(committed, root_logits, generator)
        tree, self._slots = self._grow_dynamic(_Growth(self.stage, int(committed[-1])), root_logits)
        return tree

    def commit(self, path: list[int]) -> None:
        """Keep the draft K/V of the accepted nodes (path: root first) that were fed, up to the first
        one that was not."""
        slots = []
        for node in path[1:]:
            if self._slots[node] < 0:
                break
            slots.append(self._slots[node])
        self.stage.cache.commit(torch.tensor(slots, dtype=torch.long, device=self.stage.device))

    def _choose(self, logits: torch.Tensor, k: int, draw: bool,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k children of each of E nodes with draft logits [E, V]: tokens [E, k] and, for the
        sampling rule, the distribution each was drawn from [E, k, V] (None otherwise)."""
        if not draw:
            tokens = logits.topk(k, dim=-1).indices  # [E, k]
            if self.rule != "sampling":
                return tokens, None
            return tokens, torch.nn.functional.one_hot(tokens, logits.shape[-1]).to(logits.dtype)
        remaining = probs_from_logits(logits, self.sampling)  # [E, V]
        tokens = draw_without_replacement(remaining, k, generator)  # [E, k]
        proposals = []
        for rank in range(k):
            token = tokens[:, rank : rank + 1]  # [E, 1]
            left = remaining.gather(1, token) > 0  # q's support not used up: the child was a draw
            fixed = torch.nn.functional.one_hot(token[:, 0], logits.shape[-1]).to(logits.dtype)
            proposals.append(torch.where(left, remaining / remaining.sum(-1, keepdim=True), fixed))
            remaining = remaining.scatter(1, token, 0.0)
        return tokens, torch.stack(proposals, dim=1)

    def _grow_static(self, committed: torch.Tensor, root_logits: torch.Tensor,
                     generator: torch.Generator) -> Tree:
        plan, device = self._static, self.stage.device
        prefix, fed = self.stage.cache.length, 0  # the root is the last prefix slot
        tokens = torch.empty(len(self.plan.parents), dtype=torch.long, device=device)  # [N + 1]
        tokens[:1] = committed[-1:]
        proposals = None
        for depth, level in enumerate(plan.levels):
            if depth == 0:
                logits = root_logits[None]  # [1, V]
            else:
                positions = torch.full_like(level.expanding, prefix - 1 + depth)
                mask = prefix_tree_mask(prefix, level.visible)  # [E, prefix + fed + E]
                logits = self.stage.forward(tokens[level.expanding], positions, prefix + fed, mask)  # [E, V]
                fed += level.expanding.numel()
            chosen, drawn_from = self._choose(logits, level.width, self.rule == "sampling", generator)
            tokens[level.kids] = chosen[level.rows, level.ranks]
            if drawn_from is not None:
                if proposals is None:
                    proposals = torch.zeros(tokens.numel(), logits.shape[-1], device=device)
                proposals[level.kids] = drawn_from[level.rows, level.ranks]
        return Tree(tokens, plan.parents, proposals, plan.structure)

    def _grow_dynamic(self, growth: _Growth, root_logits: torch.Tensor) -> tuple[Tree, list[int]]:
        spec: DynamicTree = self.plan
        scores = [0.0]  # cumulative draft log-probability per node
        leaves: list[int] = []
        expanding, logits = [0], root_logits[None]  # [1, V]
        for step in range(spec.depth):
            if step > 0:
                best = torch.tensor([scores[n] for n in leaves]).sort(descending=True, stable=True).indices
                expanding = [leaves[i] for i in best[: spec.width].tolist()]
                leaves = [n for n in leaves if n not in expanding]
                logits = growth.feed(expanding)  # [W, V]
            logprobs = logits.log_softmax(-1)
            chosen, drawn_from = self._choose(logits, spec.width, False, None)  # [W, k], [W, k, V] | None
            chosen_logprobs = logprobs.gather(1, chosen).tolist()
            for row, parent in enumerate(expanding):
                for rank, token in enumerate(chosen[row].tolist()):
                    proposal = None if drawn_from is None else drawn_from[row, rank]
                    leaves.append(growth.add(token, parent, proposal))
                    scores.append(scores[parent] + chosen_logprobs[row][rank])
        # Children never outscore parents and ties keep creation order, so the top set is ancestor-closed.
        order = torch.tensor(scores[1:]).sort(descending=True, stable=True).indices
        keep = sorted((order[: spec.nodes] + 1).tolist())
        return growth.tree([0] + keep)

