"""Drafting: grow one draft tree per step on a drafting stage.

With L tokens committed, the draft cache holds committed[:L - 2]: each step's catch-up feeds the
last two committed tokens (the last accepted draft, which may not have been fed, and the bonus,
which is the new root; re-feeding a fed token rewrites the same K/V). Every node that gets
children is then fed once, in batches (one per depth for static trees, one per expansion step for
dynamic trees), at draft-cache slots L + i, under a mask that shows it the prefix and its own fed
ancestors. After verification, `commit` moves the K/V of the accepted nodes to slots L - 1 + depth.

Chain and static trees are grown on the device with no host reads: their shape is known, so the
feed batches, masks, positions and child slots are constants planned once (`_StaticPlan`), and a
whole draft can be captured as one CUDA graph. Dynamic trees choose what to expand from the
scores, on the host.

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
from specgraph.runtime.stage import Stage, step_mask
from specgraph.sampling import draw_without_replacement, probs_from_logits
from specgraph.tree import Tree, TreeStructure, TreeTopology


class _Growth:
    """A dynamic tree under construction on the host; fed node i sits at draft-cache slot L + i."""

    def __init__(self, stage: Stage, root: torch.Tensor, length: torch.Tensor, width: int):
        self.stage, self.length, self.width = stage, length, width
        self.root = root  # [1] the last committed token
        self.tokens, self.parents, self.depths = [-1], [-1], [0]  # the root's token stays on the device
        self.proposals: list[torch.Tensor | None] = [None]
        self.fed_at: dict[int, int] = {}  # fed node -> its slot offset past L, in feed order

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
        first = len(self.fed_at)
        for node in nodes:
            self.fed_at[node] = len(self.fed_at)
        visible = torch.zeros(len(nodes), len(self.fed_at), dtype=torch.bool)  # [T, fed so far]
        for row, node in enumerate(nodes):
            visible[row, [self.fed_at[a] for a in self.lineage(node)]] = True
        tokens = torch.tensor([self.tokens[n] for n in nodes], device=device)
        positions = self.length - 1 + torch.tensor([self.depths[n] for n in nodes], device=device)
        slots = self.length + torch.arange(first, len(self.fed_at), device=device)
        mask = step_mask(self.length, visible.to(device), self.width)
        return self.stage.forward(tokens, positions, slots, mask)

    def tree(self, keep: list[int]) -> tuple[Tree, torch.Tensor]:
        """The tree of the `keep` nodes (ascending, ancestor-closed, root included) and each one's
        draft-cache slot offset past L (-1: not fed)."""
        index = {old: new for new, old in enumerate(keep)}
        device = self.stage.device
        tokens = torch.cat([self.root, torch.tensor([self.tokens[n] for n in keep[1:]], dtype=torch.long, device=device)])
        parents = [index.get(self.parents[n], -1) for n in keep]
        proposals = None
        if self.proposals[-1] is not None:
            vocab = self.proposals[-1].numel()
            proposals = torch.stack([torch.zeros(vocab, device=device)] + [self.proposals[n] for n in keep[1:]])
        fed_at = torch.tensor([self.fed_at.get(n, -1) for n in keep], device=device)
        tree = Tree(tokens, torch.tensor(parents, device=device), proposals, TreeStructure.of(parents, device))
        return tree, fed_at


class _Level(NamedTuple):
    """One depth of a static tree's growth (device tensors)."""

    expanding: torch.Tensor  # [E] the nodes of this depth that have children, in feed order
    offsets: torch.Tensor  # [E] their draft-cache slots past L
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
        fed_at: dict[int, int] = {}  # node -> offset of its draft-cache slot past L
        self.levels: list[_Level] = []
        for depth in range(topo.max_depth):
            expanding = topo.expanding(depth)
            if depth > 0:
                for u in expanding:
                    fed_at[u] = len(fed_at)
            visible = torch.zeros(len(expanding), len(fed_at), dtype=torch.bool)
            for row, u in enumerate(expanding):
                while u > 0:  # u and its ancestors below the root (which is in the prefix)
                    visible[row, fed_at[u]] = True
                    u = topo.parents[u]
            rows, ranks, kids = zip(*[(row, rank, kid) for row, u in enumerate(expanding)
                                      for rank, kid in enumerate(topo.children(u))])
            offsets = [fed_at.get(u, -1) for u in expanding]
            longs = [torch.tensor(x, dtype=torch.long, device=device) for x in (expanding, offsets, rows, ranks, kids)]
            self.levels.append(_Level(*longs[:2], visible.to(device), max(ranks) + 1, *longs[2:]))
        self.fed_at = torch.tensor([fed_at.get(n, -1) for n in range(len(topo.parents))], device=device)  # [N + 1]


class Drafter:
    def __init__(self, stage: Stage, plan: TreeTopology | DynamicTree, rule: str, sampling: SamplingSpec):
        self.stage, self.plan, self.rule, self.sampling = stage, plan, rule, sampling
        device = stage.device
        self.static = None if isinstance(plan, DynamicTree) else _StaticPlan(plan, device)  # the constants of a fixed shape
        self.nodes = plan.nodes if isinstance(plan, DynamicTree) else len(plan.parents) - 1
        self.max_depth = plan.depth if isinstance(plan, DynamicTree) else plan.max_depth
        self._fed_at: torch.Tensor | None = None  # [N + 1] draft-cache slot past L of each node of the last tree, -1 if not fed
        self._feeds = 2  # committed tokens the next catch-up feeds (fewer only after a one-token prompt)
        self._causal = {t: torch.ones(t, t, dtype=torch.bool, device=device).tril() for t in (1, 2)}

    @property
    def captures(self) -> bool:
        """Whether a draft is a fixed sequence of device operations (capturable as one CUDA graph)."""
        return self.static is not None and self.sampling.temperature == 0 and self._feeds == 2

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> None:
        """Feed all but the last two prompt tokens [L] (the first catch-up feeds those)."""
        if prompt.numel() > 2:
            self.stage.prefill(prompt[:-2])
        self._feeds = min(2, prompt.numel())

    @torch.inference_mode()
    def draft(self, committed: torch.Tensor, length: torch.Tensor, width: int, generator: torch.Generator | None) -> Tree:
        """A draft tree rooted at the last of the `length` ([] long) tokens of `committed` [capacity];
        forwards attend over `width` cache slots."""
        feeds, self._feeds = self._feeds, 2
        start = length - feeds
        slots = start + torch.arange(feeds, device=self.stage.device)
        mask = step_mask(start, self._causal[feeds], width)
        root_logits = self.stage.forward(committed.index_select(0, slots), slots, slots, mask)[-1]  # [V]
        root = committed.index_select(0, length.reshape(1) - 1)  # [1]
        if self.static is not None:
            self._fed_at = self.static.fed_at
            return self._grow_static(root, root_logits, length, width, generator)
        tree, self._fed_at = self._grow_dynamic(_Growth(self.stage, root, length, width), root_logits)
        return tree

    def commit(self, path: torch.Tensor, length: torch.Tensor) -> None:
        """Move the draft K/V of the accepted nodes (path [D + 1], root first, -1 padded) to slots
        L - 1 + depth, L = `length` before this step's tokens."""
        nodes = path[1:]  # [D]
        dst = length - 1 + torch.arange(1, path.numel(), device=path.device)
        offset = self._fed_at.index_select(0, nodes.clamp(min=0))
        src = torch.where((nodes >= 0) & (offset >= 0), length + offset, dst)  # unfed or rejected: stay
        self.stage.cache.move(src, dst)

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

    def _grow_static(self, root: torch.Tensor, root_logits: torch.Tensor, length: torch.Tensor, width: int,
                     generator: torch.Generator | None) -> Tree:
        plan, device = self.static, self.stage.device
        tokens = torch.empty(len(self.plan.parents), dtype=torch.long, device=device)  # [N + 1]
        tokens[:1] = root
        proposals = None
        for depth, level in enumerate(plan.levels):
            if depth == 0:
                logits = root_logits[None]  # [1, V]
            else:
                positions = (length - 1 + depth).expand(level.expanding.numel())
                mask = step_mask(length, level.visible, width)  # [E, width]
                logits = self.stage.forward(tokens[level.expanding], positions, length + level.offsets, mask)  # [E, V]
            chosen, drawn_from = self._choose(logits, level.width, self.rule == "sampling", generator)
            tokens[level.kids] = chosen[level.rows, level.ranks]
            if drawn_from is not None:
                if proposals is None:
                    proposals = torch.zeros(tokens.numel(), logits.shape[-1], device=device)
                proposals[level.kids] = drawn_from[level.rows, level.ranks]
        return Tree(tokens, plan.parents, proposals, plan.structure)

    def _grow_dynamic(self, growth: _Growth, root_logits: torch.Tensor) -> tuple[Tree, torch.Tensor]:
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

