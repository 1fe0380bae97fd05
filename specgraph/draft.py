"""Drafting: grow one draft tree per step on a drafting stage.

The root (last committed token) is fed by the stage's catch-up. Every node that gets children
is fed to the draft model once, in batches (one per depth for static trees, one per expansion
step for dynamic trees), at draft-cache slots past the committed prefix, under a mask that shows
it the prefix and its own fed ancestors. After verification, `commit` keeps the draft K/V of the
accepted nodes that were fed; the next catch-up feeds the rest.

Children are chosen per node either deterministically (top-k of the draft logits: greedy and
typical rules, and dynamic trees) or, for the sampling rule on chain and static trees, drawn
without replacement from the draft distribution q. `Tree.proposals` records the distribution
each node was drawn from, which is what lossless verification needs: q minus the earlier
siblings for draws, the node's own one-hot for deterministic choices.
"""

from __future__ import annotations

import torch

from specgraph.recipe import DynamicTree, SamplingSpec
from specgraph.runtime.stage import Stage
from specgraph.sampling import draw_without_replacement, probs_from_logits
from specgraph.tree import Tree, TreeTopology, prefix_tree_mask


class _Growth:
    """A tree under construction, with the draft-cache slot of each fed node."""

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
        return Tree(tokens, parents, proposals), [self.slot.get(n, -1) for n in keep]


class Drafter:
    def __init__(self, stage: Stage, plan: TreeTopology | DynamicTree, rule: str, sampling: SamplingSpec):
        self.stage, self.plan, self.rule, self.sampling = stage, plan, rule, sampling
        self._slots: list[int] = []  # draft-cache slot of each node of the last tree, -1 if not fed

    @torch.inference_mode()
    def draft(self, committed: torch.Tensor, generator: torch.Generator) -> Tree:
        """committed [L] -> a draft tree rooted at committed[-1]."""
        root_logits = self.stage.catch_up(committed)
        growth = _Growth(self.stage, int(committed[-1]))
        if isinstance(self.plan, DynamicTree):
            tree, self._slots = self._grow_dynamic(growth, root_logits)
        else:
            tree, self._slots = self._grow_static(growth, root_logits, generator)
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
                generator: torch.Generator) -> tuple[list[int], list[torch.Tensor | None]]:
        """k children of a node with draft logits [V]: tokens and the proposal each was drawn from."""
        if not draw:
            tokens = logits.topk(k).indices.tolist()
            if self.rule != "sampling":
                return tokens, [None] * k
            return tokens, [_one_hot(t, logits) for t in tokens]
        remaining = probs_from_logits(logits, self.sampling)
        tokens = draw_without_replacement(remaining, k, generator).tolist()
        proposals = []
        for token in tokens:
            total = remaining.sum()
            if remaining[token] > 0:
                proposals.append(remaining / total)
            else:  # q's support is used up: this child is a fixed choice
                proposals.append(_one_hot(token, logits))
            remaining = remaining.clone()
            remaining[token] = 0
        return tokens, proposals

    def _grow_static(self, growth: _Growth, root_logits: torch.Tensor,
                     generator: torch.Generator) -> tuple[Tree, list[int]]:
        topo = self.plan
        draw = self.rule == "sampling"
        depths = topo.depths
        logits_of = {0: root_logits}
        for depth in range(topo.max_depth):
            expanding = [u for u in range(len(depths)) if depths[u] == depth and topo.children(u)]
            unfed = [u for u in expanding if u not in logits_of]
            if unfed:
                logits_of.update(zip(unfed, growth.feed(unfed)))
            for u in expanding:
                kids = topo.children(u)
                tokens, proposals = self._choose(logits_of[u], len(kids), draw, generator)
                for kid, token, proposal in zip(kids, tokens, proposals):
                    assert growth.add(token, u, proposal) == kid  # topology order is creation order
        return growth.tree(list(range(len(depths))))

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
            for row, parent in enumerate(expanding):
                tokens, proposals = self._choose(logits[row], spec.width, False, None)
                for token, proposal in zip(tokens, proposals):
                    leaves.append(growth.add(token, parent, proposal))
                    scores.append(scores[parent] + float(logprobs[row, token]))
        # Children never outscore parents and ties keep creation order, so the top set is ancestor-closed.
        order = torch.tensor(scores[1:]).sort(descending=True, stable=True).indices
        keep = sorted((order[: spec.nodes] + 1).tolist())
        return growth.tree([0] + keep)


def _one_hot(token: int, like: torch.Tensor) -> torch.Tensor:
    """[V] one-hot of `token`, dtype and device of `like` [V]."""
    out = torch.zeros_like(like)
    out[token] = 1
    return out
