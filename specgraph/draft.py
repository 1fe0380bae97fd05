"""Drafting: grow one draft tree per step on a drafting stage.

With L tokens committed, the draft cache holds committed[:L - 2]: each step's catch-up feeds the
last two committed tokens (the last accepted draft, which may not have been fed, and the bonus,
which is the new root; re-feeding a fed token rewrites the same K/V). Every node that gets
children is then fed once, in batches (one per depth for static trees, one per expansion step for
dynamic trees), at draft-cache slots L + i, under a mask that shows it the prefix and its own fed
ancestors. After verification, `commit` moves the K/V of the accepted nodes to slots L - 1 + depth.

A recurrent drafter (a hybrid model: its DeltaNet layers see, besides the committed state, only
the tokens of their own forward) re-feeds the catch-up and every node fed so far with each batch,
as one tree, so that each node sees all its ancestors; a forward of a few dozen tokens costs a
small model about what one token does. Its commit folds the catch-up and the accepted nodes but
the last (which the next catch-up feeds) from the last forward's factors into its state.

Every tree is grown on the device with no host reads, so a whole draft can be captured as one
CUDA graph. A static tree's shape is known: its feed batches, masks, positions and child slots are
constants planned once (`_StaticPlan`). A dynamic tree's growth has a known size too: each
expansion step feeds `width` leaves into fixed slots and gives each `width` children in a fixed
pool of nodes (`_DynamicPlan`); which leaves, and which nodes are kept, are chosen on the device.

Children are chosen per node either deterministically (top-k of the draft logits: greedy and
typical rules, and dynamic trees) or, for the sampling rule on chain and static trees, drawn
without replacement from the draft distribution q. `Tree.proposals` records the distribution
each node was drawn from, which is what lossless verification needs: q minus the earlier
siblings for draws, the node's own one-hot for deterministic choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specgraph.recipe import DynamicTree, SamplingSpec
from specgraph.runtime.stage import Stage
from specgraph.sampling import draw_without_replacement, probs_from_logits
from specgraph.tree import Tree, TreeStructure, TreeTopology


class _DynamicPlan:
    """The constants of growing a dynamic tree on a device. Its nodes live in a pool of
    1 + W + (D - 1) W^2 (W = width, D = depth): the root, its W children, then the W children of
    each leaf expanded at each later step, in creation order (parents first). Expansion step s
    feeds its W leaves at draft-cache slots L + (s - 1) W + row."""

    def __init__(self, spec: DynamicTree):
        self.width, self.depth, self.nodes = spec.width, spec.depth, spec.nodes
        self.pool = 1 + spec.width + (spec.depth - 1) * spec.width ** 2
        self.fed = (spec.depth - 1) * spec.width  # draft-cache slots past L that the growth writes

    def first_child(self, step: int) -> int:
        """Pool index of the first node that expansion step `step` creates."""
        return 1 if step == 0 else 1 + self.width + (step - 1) * self.width ** 2


class _Level(NamedTuple):
    """One depth of a static tree's growth (device tensors)."""

    expanding: torch.Tensor  # [E] the nodes of this depth that have children, in feed order
    fed: int  # nodes fed once this depth is: the plan's first `fed` in feed order, these E last
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
        fed = [u for depth in range(1, topo.max_depth) for u in topo.expanding(depth)]  # feed order
        fed_at = {u: offset for offset, u in enumerate(fed)}  # node -> offset of its draft-cache slot past L
        lineage = torch.zeros(len(fed), len(fed), dtype=torch.bool)
        for row, u in enumerate(fed):
            while u > 0:  # u and its ancestors below the root (which is in the prefix)
                lineage[row, fed_at[u]] = True
                u = topo.parents[u]
        self.fed = torch.tensor(fed, dtype=torch.long, device=device)  # [F]
        self.fed_depths = self.structure.depths[self.fed]  # [F]
        self.lineage = lineage.to(device)  # [F, F] each fed node's fed ancestors and itself
        self.levels: list[_Level] = []
        fed_so_far = 0
        for depth in range(topo.max_depth):
            expanding = topo.expanding(depth)
            fed_so_far += len(expanding) if depth > 0 else 0  # (the root comes from the catch-up)
            rows, ranks, kids = zip(*[(row, rank, kid) for row, u in enumerate(expanding)
                                      for rank, kid in enumerate(topo.children(u))])
            longs = [torch.tensor(x, dtype=torch.long, device=device) for x in (rows, ranks, kids)]
            self.levels.append(_Level(torch.tensor(expanding, device=device), fed_so_far, max(ranks) + 1, *longs))
        self.fed_at = torch.tensor([fed_at.get(n, -1) for n in range(len(topo.parents))], device=device)  # [N + 1]


CATCH_UP = 2  # committed tokens a catch-up feeds: the last accepted draft (maybe never fed) and the new root


def catch_up(stage: Stage, committed: torch.Tensor, length: torch.Tensor, width: int, feeds: int = CATCH_UP
             ) -> torch.Tensor:
    """Feed the last `feeds` of the `length` ([] long) tokens of `committed` [capacity] at their
    slots, over `width` virtual slots -> the root's logits [V]."""
    start = length - feeds
    offsets = torch.arange(feeds, device=stage.device)
    causal = torch.ones(feeds, feeds, dtype=torch.bool, device=stage.device).tril()
    return stage.forward_one(committed.index_select(0, start + offsets), start + offsets, start, offsets, causal,
                             width)[-1]


class _Step(NamedTuple):
    """What a draft step's forwards share: the committed tokens [capacity] and their count
    ([] long), the slots they attend over, and how many committed tokens the catch-up fed."""

    committed: torch.Tensor
    length: torch.Tensor
    width: int
    feeds: int


@dataclass
class Draft:
    """A grown tree and where its nodes were fed: the handle that `Drafter.commit` takes, so that
    nothing about a step is kept in the drafter between its draft and its commit."""

    tree: Tree
    fed_at: torch.Tensor  # [N + 1] draft-cache slot past L of each node, -1 if not fed
    feeds: int = CATCH_UP  # committed tokens its catch-up fed

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tree's tensors, then fed_at: a deterministic draft as a CUDA graph's outputs."""
        return (*self.tree.tensors(), self.fed_at)

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...], max_depth: int) -> Draft:
        return cls(Tree.from_tensors(tensors[:-1], max_depth), tensors[-1])


class Drafter:
    def __init__(self, stage: Stage, plan: TreeTopology | DynamicTree, rule: str, sampling: SamplingSpec,
                 max_feeds: int = CATCH_UP):
        """`max_feeds`: the most committed tokens a catch-up feeds (a pipeline's first stage may
        have adopted one token from each stage above since its last step)."""
        self.stage, self.plan, self.rule, self.sampling, self.max_feeds = stage, plan, rule, sampling, max_feeds
        device = stage.device
        self.static = None if isinstance(plan, DynamicTree) else _StaticPlan(plan, device)  # the constants of a fixed shape
        self.dynamic = _DynamicPlan(plan) if isinstance(plan, DynamicTree) else None
        self.nodes = plan.nodes if isinstance(plan, DynamicTree) else len(plan.parents) - 1
        self.max_depth = plan.depth if isinstance(plan, DynamicTree) else plan.max_depth
        self._causal = {t: torch.ones(t, t, dtype=torch.bool, device=device).tril() for t in range(1, max_feeds + 1)}
        self.refeeds = stage.cache.recurrent  # each forward re-feeds the catch-up and every fed node (module doc)
        self._row = torch.zeros(1, dtype=torch.long, device=device)  # the request's row of the table

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> None:
        """Feed all but the last two prompt tokens [L] (the first catch-up feeds those)."""
        self.stage.reset()
        if prompt.numel() > CATCH_UP:
            self.stage.prefill(prompt[:-CATCH_UP])

    @torch.inference_mode()
    def draft(self, committed: torch.Tensor, length: torch.Tensor, width: int, generator: torch.Generator | None,
              feeds: int = CATCH_UP) -> Draft:
        """A draft tree rooted at the last of the `length` ([] long) tokens of `committed` [capacity];
        forwards attend over `width` cache slots. The catch-up feeds the last `feeds` committed tokens
        (fewer than two only right after a one-token prompt)."""
        root_logits = self.catch_up(committed, length, width, feeds)
        root = committed.index_select(0, length.reshape(1) - 1)  # [1]
        step = _Step(committed, length, width, feeds)
        if self.static is not None:
            return Draft(self._grow_static(root, root_logits, step, generator), self.static.fed_at, feeds)
        return Draft(*self._grow_dynamic(root, root_logits, step), feeds)

    def catch_up(self, committed: torch.Tensor, length: torch.Tensor, width: int, feeds: int = CATCH_UP) -> torch.Tensor:
        return catch_up(self.stage, committed, length, width, feeds)

    def commit(self, draft: Draft, path: torch.Tensor, length: torch.Tensor) -> None:
        """Move the draft K/V of `draft`'s accepted nodes (path [D + 1], root first, -1 padded) to
        slots L - 1 + depth, L = `length` before this step's tokens."""
        nodes = path[1:]  # [D]
        dst = length - 1 + torch.arange(1, path.numel(), device=path.device)
        offset = draft.fed_at.index_select(0, nodes.clamp(min=0))
        src = torch.where((nodes >= 0) & (offset >= 0), length + offset, dst)  # unfed or rejected: stay
        stage, row = self.stage, self._row
        stage.cache.move(stage.table, row, src[None], dst[None])
        if self.refeeds:  # the state to committed[:L' - 2]: the catch-up and the accepted nodes but the last
            fed = torch.cat([torch.arange(draft.feeds, device=path.device), draft.feeds + offset])  # [feeds + D]
            folded = draft.feeds + (nodes >= 0).sum() - 1  # (the accepted nodes but the last were fed: they have children)
            stage.cache.fold(row, torch.where(torch.arange(fed.numel(), device=path.device) < folded, fed, -1)[None])

    def _feed(self, tokens: torch.Tensor, depths: torch.Tensor, lineage: torch.Tensor, new: int,
              step: _Step) -> torch.Tensor:
        """Feed the last `new` of the F nodes fed so far this step (tokens, depths [F], in feed order;
        lineage [F, F] bool: each one's fed ancestors and itself) at draft-cache slots L + offset ->
        their logits [new, V]. A recurrent stage re-feeds the catch-up and all F, as one tree."""
        length, f = step.length, tokens.numel()
        positions, offsets = length - 1 + depths, torch.arange(f, device=tokens.device)  # [F]
        if not self.refeeds:
            return self.stage.forward_one(tokens[-new:], positions[-new:], length, offsets[-new:], lineage[-new:],
                                          step.width)
        feeds = step.feeds
        start = length - feeds
        caught = start + torch.arange(feeds, device=tokens.device)  # [feeds] the catch-up's slots
        visible = torch.cat([torch.cat([self._causal[feeds], lineage.new_zeros(feeds, f)], 1),
                             torch.cat([lineage.new_ones(f, feeds), lineage], 1)])  # [feeds + F, feeds + F]
        logits = self.stage.forward_one(torch.cat([step.committed.index_select(0, caught), tokens]),
                                        torch.cat([caught, positions]), start,
                                        torch.arange(feeds + f, device=tokens.device), visible, step.width)
        return logits[-new:]

    def _choose(self, logits: torch.Tensor, k: int, draw: bool,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k children of each of E nodes of a static tree with draft logits [E, V]: tokens [E, k]
        and, where they are drawn (the sampling rule), the distribution each was drawn from [E, k, V]
        (None for the top-k)."""
        if not draw:
            return logits.topk(k, dim=-1).indices, None  # [E, k]
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

    def _grow_static(self, root: torch.Tensor, root_logits: torch.Tensor, step: _Step,
                     generator: torch.Generator | None) -> Tree:
        plan, device = self.static, self.stage.device
        tokens = torch.empty(len(self.plan.parents), dtype=torch.long, device=device)  # [N + 1]
        tokens[:1] = root
        proposals = None
        for depth, level in enumerate(plan.levels):
            if depth == 0:
                logits = root_logits[None]  # [1, V]
            else:
                fed = plan.fed[: level.fed]
                logits = self._feed(tokens[fed], plan.fed_depths[: level.fed], plan.lineage[: level.fed, : level.fed],
                                    level.expanding.numel(), step)  # [E, V]
            chosen, drawn_from = self._choose(logits, level.width, self.rule == "sampling", generator)
            tokens[level.kids] = chosen[level.rows, level.ranks]
            if drawn_from is not None:
                if proposals is None:
                    proposals = torch.zeros(tokens.numel(), logits.shape[-1], device=device)
                proposals[level.kids] = drawn_from[level.rows, level.ranks]
        return Tree(tokens, plan.parents, proposals, plan.structure)

    def _grow_dynamic(self, root: torch.Tensor, root_logits: torch.Tensor, step: _Step) -> tuple[Tree, torch.Tensor]:
        """Maximum-likelihood expansion: each step feeds the W leaves of highest cumulative draft
        log-probability (ties: the earlier created) and gives each its W most likely children;
        the tree keeps the `nodes` most likely nodes. Returns it and each node's fed-slot offset past L."""
        plan, device = self.dynamic, self.stage.device
        w, size = plan.width, plan.pool
        tokens = torch.zeros(size, dtype=torch.long, device=device)  # [P]
        tokens[:1] = root
        parents = torch.full((size,), -1, dtype=torch.long, device=device)
        depths = torch.zeros(size, dtype=torch.long, device=device)
        scores = torch.zeros(size, dtype=torch.float64, device=device)  # cumulative log-probability (fp64: exact sums)
        lineage = torch.eye(size, dtype=torch.bool, device=device)  # [P, P] row i: i and its ancestors
        lineage[:, 0].fill_(True)  # (fill_: no host value copied in)
        leaf = torch.zeros(size, dtype=torch.bool, device=device)  # created and not expanded
        fed = torch.zeros(plan.fed, dtype=torch.long, device=device)  # fed slot -> node
        fed_at = torch.full((size,), -1, dtype=torch.long, device=device)  # node -> fed slot
        expanding, logits = torch.zeros(1, dtype=torch.long, device=device), root_logits[None]  # [E], [E, V]
        for s in range(plan.depth):
            if s > 0:
                best = torch.where(leaf, scores, float("-inf")).sort(descending=True, stable=True).indices
                expanding = best[:w]  # [W]
                leaf.index_fill_(0, expanding, False)
                offsets = (s - 1) * w + torch.arange(w, device=device)  # [W]
                fed[offsets] = expanding
                fed_at[expanding] = offsets
                so_far = fed[: s * w]  # [F]
                logits = self._feed(tokens[so_far], depths[so_far], lineage[so_far][:, so_far], w, step)  # [W, V]
            chosen = logits.topk(w, dim=-1).indices  # [E, W]
            gained = logits.log_softmax(-1).gather(1, chosen)  # [E, W]
            kids = slice(plan.first_child(s), plan.first_child(s) + chosen.numel())
            parent = expanding.repeat_interleave(w)  # [E W]
            tokens[kids], parents[kids], depths[kids] = chosen.flatten(), parent, depths[parent] + 1
            scores[kids] = scores[parent] + gained.flatten().double()
            leaf[kids].fill_(True)
            lineage[kids] |= lineage[parent]
        # Children never outscore parents and ties keep creation order, so the top set is ancestor-closed.
        top = scores[1:].sort(descending=True, stable=True).indices[: plan.nodes] + 1
        keep = torch.cat([torch.zeros(1, dtype=torch.long, device=device), top.sort().values])  # [N + 1], parents first
        index = torch.full((size,), -1, dtype=torch.long, device=device)
        index[keep] = torch.arange(keep.numel(), device=device)
        kept_parents = parents[keep]
        tree_parents = torch.where(kept_parents >= 0, index[kept_parents.clamp(min=0)], -1)  # [N + 1]
        structure = TreeStructure.on_device(tree_parents, depths[keep], lineage[keep][:, keep], plan.depth, w)
        proposals = None
        if self.rule == "sampling":  # children are chosen, not drawn: each node's proposal is its own one-hot
            proposals = torch.nn.functional.one_hot(tokens[keep], logits.shape[-1]).to(logits.dtype)
            proposals[0].zero_()
        return Tree(tokens[keep], tree_parents, proposals, structure), fed_at[keep]
