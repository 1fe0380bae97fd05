"""Drafting: grow one draft tree per request per step on a drafting stage, for R requests at once.

With L tokens committed, a request's draft cache holds committed[:L - 2]: each step's catch-up
feeds the last two committed tokens (the last accepted draft, which may not have been fed, and the
bonus, which is the new root; re-feeding a fed token rewrites the same K/V). Every node that gets
children is then fed once, in batches (one per depth for static trees, one per expansion step for
dynamic trees), at draft-cache virtual slots L + i, under a mask that shows it the prefix and its
own fed ancestors. Each batch holds every request's nodes: one forward for all of them. After
verification, `commit` moves the K/V of the accepted nodes to slots L - 1 + depth.

A recurrent drafter (a hybrid model: its DeltaNet layers see, besides the committed state, only
the tokens of their own forward) re-feeds the catch-up and every node fed so far with each batch,
as one tree, so that each node sees all its ancestors; a forward of a few dozen tokens costs a
small model about what one token does. Its commit folds the catch-up and the accepted nodes but
the last (which the next catch-up feeds) from the last forward's factors into its state.

Every tree is grown on the device with no host reads, so a whole draft can be captured as one
CUDA graph. A static tree's shape is known: its feed batches, masks, positions and child slots are
constants planned once (`_StaticPlan`). A dynamic tree's growth has a known size too: each
expansion step feeds `width` leaves into fixed slots and gives each `width` children in a fixed
pool of nodes (`_DynamicPlan`); which leaves, and which nodes are kept, are chosen on the device,
per request — or, with a verification budget (engine/budget.py), the most likely nodes over the
whole batch.

Children are chosen per node in one of two ways. Greedy and typical rules: the top-k of the
draft logits (dynamic trees: the most likely leaves expanded first). Sampling rule: the top-k of
the perturbed scores log q + g(seed, t, ·), t the children's sequence index (sampling.py): Gumbel
top-k, draws without replacement from q with the noise the target samples with, so that the
target's token is often among them; a dynamic tree expands the leaves whose perturbed scores fall
least below their best sibling's, summed over their path (`perturbed_children`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specgraph.recipe import DynamicTree
from specgraph.runtime.stage import Stage
from specgraph.sampling import SamplingRows, forbid_stops, perturbed_top
from specgraph.tree import CATCH_UP, Tree, TreeStructure, TreeTopology


UNLIKELY = -1e4  # a dynamic tree's score step for a child that cannot be sampled


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
        self.fed_depths = self.structure.depths[0, self.fed]  # [F]
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
        self.sources = self.fed_at[self.parents[self.fed]]  # [F] feed offset of each fed node's parent (-1: the root)


class Requests(NamedTuple):
    """The requests of a step, on the device: their rows of the stage's table, the committed tokens
    of every row (tokens [rows, capacity]), each one's committed count, and how many committed
    tokens its catch-up feeds (feeds [R], at most `max_feeds`)."""

    rows: torch.Tensor  # [R]
    tokens: torch.Tensor  # [rows, capacity]
    lengths: torch.Tensor  # [R]
    feeds: torch.Tensor  # [R]
    max_feeds: int
    features: torch.Tensor | None = None  # [R, max_feeds, C H] a head's: the target's features of the tokens fed

    @classmethod
    def one(cls, tokens: torch.Tensor, length: torch.Tensor, feeds: int = CATCH_UP) -> Requests:
        """One request, in table row 0: its committed tokens [capacity], their count [] and the catch-up's."""
        device = tokens.device
        return cls(torch.zeros(1, dtype=torch.long, device=device), tokens[None], length.reshape(1),
                   torch.full((1,), feeds, device=device), feeds)

    @property
    def size(self) -> int:
        return self.rows.numel()

    def last(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `count` committed virtual slots of each request, oldest first, and their tokens [R, count]."""
        slots = (self.lengths[:, None] - count + torch.arange(count, device=self.rows.device)).clamp(min=0)
        return slots, self.tokens[self.rows[:, None], slots]


def catch_up(stage: Stage, requests: Requests, width: int) -> torch.Tensor:
    """Feed each request's last feeds[r] committed tokens at their slots -> the roots' logits [R, V]."""
    slots, tokens = requests.last(requests.max_feeds)  # [R, F]: a request feeding fewer takes its last ones
    lag = requests.max_feeds - requests.feeds  # [R]: leading columns a request does not feed
    index = (torch.arange(requests.max_feeds, device=slots.device) + lag[:, None]).clamp(max=requests.max_feeds - 1)
    slots, tokens = slots.gather(1, index), tokens.gather(1, index)  # each request's fed tokens first
    offsets = torch.arange(requests.max_feeds, device=slots.device).expand(requests.size, -1)
    causal = torch.ones(requests.max_feeds, requests.max_feeds, dtype=torch.bool, device=slots.device).tril()
    logits = stage.forward_rows(tokens, slots, requests.rows, requests.lengths - requests.feeds, offsets,
                                causal.expand(requests.size, -1, -1), width, requests.feeds)
    return logits.gather(1, (requests.feeds - 1)[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]


def best_children(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` most likely next tokens after each node (logits [..., V]) and their draft
    log-probabilities [..., W]: a dynamic tree's children, a growing tree's."""
    tokens = logits.topk(width, dim=-1).indices
    return tokens, logits.float().log_softmax(-1).gather(-1, tokens)


def perturbed_children(logits: torch.Tensor, width: int, sampling: SamplingRows, positions: torch.Tensor,
                       kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling rule's children of each node (logits [R, E, V], their tokens at sequence indices
    positions [R, E]): the `width` best by perturbed score [R, E, W], and each one's score less the
    best's (<= 0, so a path's sum never grows: a selection by it is ancestor-closed; a child past
    the filters' tokens, which the target never samples, gets UNLIKELY, finite, so that it stays a
    leaf to expand last)."""
    tokens, scores = perturbed_top(logits, sampling, positions, width, kernel)
    return tokens, (scores - scores[..., :1]).clamp(min=UNLIKELY)


@dataclass
class Draft:
    """The grown trees and where their nodes were fed: the handle that `Drafter.commit` takes, so
    that nothing about a step is kept in the drafter between its draft and its commit."""

    tree: Tree
    fed_at: torch.Tensor  # [R, N + 1] draft-cache slot past L of each node, -1 if not fed
    feeds: torch.Tensor  # [R] committed tokens each catch-up fed

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The trees' tensors, then fed_at and feeds: a deterministic draft as a CUDA graph's outputs."""
        return (*self.tree.tensors(), self.fed_at, self.feeds)

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...], max_depth: int, packed: int | None = None) -> Draft:
        return cls(Tree.from_tensors(tensors[:-2], max_depth, packed), *tensors[-2:])


class _Grown(NamedTuple):
    """A dynamic growth's pool, per request: what selecting the trees to verify reads."""

    tokens: torch.Tensor  # [R, P]
    parents: torch.Tensor  # [R, P]
    depths: torch.Tensor  # [R, P]
    scores: torch.Tensor  # [R, P] cumulative draft log-probability (fp64: exact sums)
    lineage: torch.Tensor  # [R, P, P] row i: i and its ancestors
    fed_at: torch.Tensor  # [R, P]


class Drafter:
    def __init__(self, stage: Stage, tree: TreeTopology | DynamicTree, rule: str, max_feeds: int = CATCH_UP):
        """`tree`: what it grows, a fixed topology or a dynamic tree's sizes; `max_feeds`: the most
        committed tokens a catch-up feeds (a pipeline's first stage may have adopted one token from
        each stage above since its last step)."""
        self.stage, self.tree, self.rule, self.max_feeds = stage, tree, rule, max_feeds
        device = stage.device
        self.static = None if isinstance(tree, DynamicTree) else _StaticPlan(tree, device)  # the constants of a fixed shape
        self.dynamic = _DynamicPlan(tree) if isinstance(tree, DynamicTree) else None
        self.nodes = tree.nodes if isinstance(tree, DynamicTree) else len(tree.parents) - 1
        self.max_depth = tree.depth if isinstance(tree, DynamicTree) else tree.max_depth
        self.refeeds = stage.cache.recurrent  # each forward re-feeds the catch-up and every fed node (module doc)
        self.span = self.dynamic.fed if self.dynamic is not None else len(self.static.fed)  # slots fed past L

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> None:
        """A new request in table row 0: feed all but the last two prompt tokens [L] (the first catch-up feeds those)."""
        self.stage.reset()
        if prompt.numel() > CATCH_UP:
            self.stage.prefill(prompt[:-CATCH_UP])

    @torch.inference_mode()
    def draft(self, requests: Requests, width: int, sampling: SamplingRows | None = None,
              budget: int | None = None, live: torch.Tensor | None = None) -> Draft:
        """A draft tree per request, rooted at its last committed token; forwards attend over `width`
        virtual slots. `sampling`: the requests' settings (their seeds key the sampling rule's noise;
        stop tokens are kept back as they say). `budget`: a dynamic tree's
        nodes over the whole batch (each request at most the plan's `nodes`), None: each its own;
        `live` [R] bool: the requests that take part in the budget (padding rows do not)."""
        root_logits = catch_up(self.stage, requests, width)  # [R, V]

        def feed(tokens, depths, lineage, sources, new):
            return self._feed(tokens, depths, lineage, new, requests, width)

        return self._grow(root_logits, requests, feed, sampling, budget, live)

    def _grow(self, root_logits: torch.Tensor, requests: Requests, feed, sampling: SamplingRows | None,
              budget: int | None, live: torch.Tensor | None) -> Draft:
        """The trees grown from the roots' logits [R, V]; `feed(tokens, depths, lineage, sources,
        new)` feeds the last `new` of the F nodes fed so far (tokens, depths, sources [R, F]: each
        one's parent's feed offset, -1 the root; lineage [R, F, F]) -> their logits [R, new, V]. No
        stop token is proposed where the target may not choose it (sampling.forbid_stops)."""
        roots = requests.last(1)[1]  # [R, 1]
        if sampling is not None and sampling.forbids:  # (a node at depth d proposes the token at sequence index L + d)
            root_logits = forbid_stops(root_logits, sampling, requests.lengths)
            feed = _forbidding(feed, sampling, requests.lengths)
        if self.static is not None:
            return Draft(self._grow_static(roots, root_logits, requests, feed, sampling),
                         self.static.fed_at.expand(requests.size, -1), requests.feeds)
        grown = self._grow_dynamic(roots, root_logits, requests, feed, sampling)
        return select(grown, self.dynamic.nodes, self.dynamic.depth, self.dynamic.width, budget, requests.feeds, live)

    def commit(self, draft: Draft, paths: torch.Tensor, requests: Requests) -> None:
        """Move the draft K/V of each request's accepted nodes (paths [R, D + 1], root first, -1
        padded) to slots L - 1 + depth, L = its committed count before this step's tokens."""
        nodes = paths[:, 1:]  # [R, D]
        lengths, device = requests.lengths[:, None], paths.device
        dst = lengths - 1 + torch.arange(1, paths.shape[1], device=device)  # [R, D]
        offset = draft.fed_at.gather(1, nodes.clamp(min=0))
        src = torch.where((nodes >= 0) & (offset >= 0), lengths + offset, dst)  # unfed or rejected: stay
        self.stage.cache.move(self.stage.table, requests.rows, src, dst)
        if self.refeeds:  # the state to committed[:L' - 2]: the catch-up and the accepted nodes but the last
            column = torch.arange(requests.max_feeds + nodes.shape[1], device=device)  # [F + D]
            feeds = draft.feeds[:, None]
            fed = torch.where(column < feeds, column, feeds + offset.gather(1, (column - feeds).clamp(
                0, nodes.shape[1] - 1).expand(requests.size, -1)))  # [R, F + D]: rows of the last forward
            folded = feeds + (nodes >= 0).sum(1, keepdim=True) - 1  # (the accepted nodes but the last were fed)
            self.stage.cache.fold(requests.rows, torch.where(column < folded, fed, -1))

    def _feed(self, tokens: torch.Tensor, depths: torch.Tensor, lineage: torch.Tensor, new: int,
              requests: Requests, width: int) -> torch.Tensor:
        """Feed the last `new` of the F nodes each request fed so far this step (tokens, depths [R, F],
        in feed order; lineage [R, F, F] bool: each one's fed ancestors and itself) at draft-cache
        slots L + offset -> their logits [R, new, V]. A recurrent stage re-feeds the catch-up and all
        F, as one tree."""
        r, f = tokens.shape
        lengths, device = requests.lengths, tokens.device
        positions, offsets = lengths[:, None] - 1 + depths, torch.arange(f, device=device).expand(r, -1)  # [R, F]
        if not self.refeeds:
            return self.stage.forward_rows(tokens[:, -new:], positions[:, -new:], requests.rows, lengths,
                                           offsets[:, -new:], lineage[:, -new:], width)
        feeds, most = requests.feeds, requests.max_feeds
        slots, caught = requests.last(most)  # [R, most]
        lag = most - feeds
        index = (torch.arange(most, device=device) + lag[:, None]).clamp(max=most - 1)
        slots, caught = slots.gather(1, index), caught.gather(1, index)  # each request's fed tokens first
        # each request's forward: its feeds[r] catch-up tokens (causal), then the F nodes (seeing the
        # whole catch-up and their lineage), at region offsets 0, 1, ... from its catch-up's first slot
        column = torch.arange(most + f, device=device)
        catch = column[None] < feeds[:, None]  # [R, C]
        node = column[None] - feeds[:, None]  # [R, C]: node index of a node column
        is_node = (node >= 0) & (node < f)
        at_catch, at_node = column.clamp(max=most - 1).expand(r, -1), node.clamp(0, f - 1)
        tokens_all = torch.where(catch, caught.gather(1, at_catch), tokens.gather(1, at_node))
        positions_all = torch.where(catch, slots.gather(1, at_catch), positions.gather(1, at_node))
        ancestry = lineage.gather(1, at_node[..., None].expand(-1, -1, f)).gather(2, at_node[:, None, :].expand(
            -1, most + f, -1))  # [R, C, C]: lineage between the columns' nodes
        visible = ((catch[:, :, None] & catch[:, None, :] & (column[None, None, :] <= column[None, :, None]))
                   | (is_node[:, :, None] & catch[:, None, :])
                   | (is_node[:, :, None] & is_node[:, None, :] & ancestry))
        logits = self.stage.forward_rows(tokens_all, positions_all, requests.rows, lengths - feeds,
                                         column.expand(r, -1), visible, width, feeds + f)  # [R, most + F, V]
        last = feeds[:, None] + f - new + torch.arange(new, device=device)  # [R, new]: the new nodes' columns
        return logits.gather(1, last[..., None].expand(-1, -1, logits.shape[-1]))

    def _choose(self, logits: torch.Tensor, k: int, sampling: SamplingRows | None,
                positions: torch.Tensor) -> torch.Tensor:
        """k children of each of E nodes of R static trees with draft logits [R, E, V], their tokens at
        sequence indices positions [R, E] -> tokens [R, E, k]: the top-k, by perturbed score under
        the sampling rule."""
        if self.rule == "sampling":
            return perturbed_top(logits, sampling, positions, k, self.stage.kernels.perturbed_top)[0]
        return logits.topk(k, dim=-1).indices

    def _grow_static(self, roots: torch.Tensor, root_logits: torch.Tensor, requests: Requests, feed,
                     sampling: SamplingRows | None) -> Tree:
        plan, device, r = self.static, self.stage.device, requests.size
        tokens = torch.empty(r, len(self.tree.parents), dtype=torch.long, device=device)  # [R, N + 1]
        tokens[:, :1] = roots
        for depth, level in enumerate(plan.levels):
            if depth == 0:
                logits = root_logits[:, None]  # [R, 1, V]
            else:
                fed = plan.fed[: level.fed]
                logits = feed(tokens[:, fed], plan.fed_depths[: level.fed].expand(r, -1),
                              plan.lineage[: level.fed, : level.fed].expand(r, -1, -1),
                              plan.sources[: level.fed].expand(r, -1), level.expanding.numel())  # [R, E, V]
            positions = (requests.lengths + depth)[:, None].expand(r, logits.shape[1])  # [R, E]: the children's
            chosen = self._choose(logits, level.width, sampling, positions)  # [R, E, W]
            tokens[:, level.kids] = chosen[:, level.rows, level.ranks]
        return Tree(tokens, plan.parents.expand(r, -1), plan.structure.expand(r))

    def _grow_dynamic(self, roots: torch.Tensor, root_logits: torch.Tensor, requests: Requests, feed,
                      sampling: SamplingRows | None) -> _Grown:
        """Maximum-likelihood expansion, per request: each step feeds the W leaves of highest
        cumulative draft log-probability (ties: the earlier created) and gives each its W most
        likely children; under the sampling rule, by perturbed scores (`perturbed_children`)."""
        plan, device, r = self.dynamic, self.stage.device, requests.size
        w, size = plan.width, plan.pool
        rows = torch.arange(r, device=device)[:, None]
        tokens = torch.zeros(r, size, dtype=torch.long, device=device)  # [R, P]
        tokens[:, :1] = roots
        parents = torch.full((r, size), -1, dtype=torch.long, device=device)
        depths = torch.zeros(r, size, dtype=torch.long, device=device)
        scores = torch.zeros(r, size, dtype=torch.float64, device=device)
        lineage = torch.eye(size, dtype=torch.bool, device=device).repeat(r, 1, 1)  # [R, P, P]
        lineage[:, :, 0].fill_(True)  # (fill_: no host value copied in)
        leaf = torch.zeros(r, size, dtype=torch.bool, device=device)  # created and not expanded
        fed = torch.zeros(r, plan.fed, dtype=torch.long, device=device)  # fed slot -> node
        fed_at = torch.full((r, size), -1, dtype=torch.long, device=device)  # node -> fed slot
        expanding, logits = torch.zeros(r, 1, dtype=torch.long, device=device), root_logits[:, None]  # [R, E], [R, E, V]
        for s in range(plan.depth):
            if s > 0:
                best = torch.where(leaf, scores, float("-inf")).sort(dim=1, descending=True, stable=True).indices
                expanding = best[:, :w]  # [R, W]
                leaf.scatter_(1, expanding, False)
                offsets = (s - 1) * w + torch.arange(w, device=device)  # [W]
                fed[:, offsets] = expanding
                fed_at.scatter_(1, expanding, offsets.expand(r, -1))
                so_far = fed[:, : s * w]  # [R, F]
                seen = lineage[rows, so_far].gather(2, so_far[:, None, :].expand(-1, s * w, -1))  # [R, F, F]
                logits = feed(tokens.gather(1, so_far), depths.gather(1, so_far), seen,
                              fed_at.gather(1, parents.gather(1, so_far)), w)
            if self.rule == "sampling":  # (children of nodes at depth d take sequence index L + d)
                positions = requests.lengths[:, None] + depths.gather(1, expanding)  # [R, E]
                chosen, gained = perturbed_children(logits, w, sampling, positions, self.stage.kernels.perturbed_top)
            else:
                chosen, gained = best_children(logits, w)  # [R, E, W]
            kids = slice(plan.first_child(s), plan.first_child(s) + chosen.shape[1] * w)
            parent = expanding.repeat_interleave(w, dim=1)  # [R, E W]
            tokens[:, kids], parents[:, kids] = chosen.flatten(1), parent
            depths[:, kids] = depths.gather(1, parent) + 1
            scores[:, kids] = scores.gather(1, parent) + gained.flatten(1).double()
            leaf[:, kids].fill_(True)
            lineage[:, kids] |= lineage[rows, parent]
        return _Grown(tokens, parents, depths, scores, lineage, fed_at)


def _forbidding(feed, sampling: SamplingRows, lengths: torch.Tensor):
    """`feed` (Drafter._grow's), its nodes' logits without the stop tokens their children may not be."""

    def fed(tokens, depths, lineage, sources, new):
        return forbid_stops(feed(tokens, depths, lineage, sources, new), sampling, lengths[:, None] + depths[:, -new:])

    return fed


def select(grown: _Grown, nodes: int, depth: int, width: int, budget: int | None, feeds: torch.Tensor,
           live: torch.Tensor | None = None) -> Draft:
    """The trees to verify: each request's `nodes` most likely nodes or, with a `budget`, the
    `budget` most likely over the whole batch (each request at most `nodes`; only `live` [R] ones
    where given), in pool order (parents
    first) -> a Draft of trees [R, nodes + 1] whose rows hold sizes[r] nodes. Children never
    outscore parents and ties keep creation order, so every selection is ancestor-closed."""
    r, size = grown.scores.shape
    device = grown.scores.device
    ranked = grown.scores[:, 1:].sort(dim=1, descending=True, stable=True)
    top = ranked.indices[:, :nodes] + 1  # [R, N]: each request's most likely, best first
    chosen = torch.ones(r, nodes, dtype=torch.bool, device=device)
    if budget is not None:  # the budget's nodes: the best of all requests' candidates (ties: request order)
        candidates = ranked.values[:, :nodes]
        if live is not None:
            candidates = torch.where(live[:, None], candidates, float("-inf"))
        flat = candidates.flatten().sort(descending=True, stable=True).indices[:budget]
        chosen = torch.zeros(r * nodes, dtype=torch.bool, device=device).index_fill_(0, flat, True).view(r, nodes)
        if live is not None:  # (a budget past the live rows' candidates: the rest of its packed tokens are padding)
            chosen &= live[:, None]
    sizes = 1 + chosen.sum(1)  # [R]
    order = torch.where(chosen, top, size + top).sort(dim=1).values  # [R, N]: chosen in pool order, the rest after
    keep = torch.cat([torch.zeros(r, 1, dtype=torch.long, device=device), order.clamp(max=size - 1)], 1)  # [R, N + 1]
    live = torch.arange(nodes + 1, device=device)[None] < sizes[:, None]
    index = torch.full((r, size), -1, dtype=torch.long, device=device)
    index.scatter_(1, torch.where(live, keep, 0), torch.where(live, torch.arange(nodes + 1, device=device), 0))
    kept_parents = grown.parents.gather(1, keep)
    parents = torch.where(kept_parents >= 0, index.gather(1, kept_parents.clamp(min=0)), -1)
    parents = torch.where(live, parents, 0)  # padding: children of the root, never verified (sizes)
    rows = torch.arange(r, device=device)[:, None]
    lineage = grown.lineage[rows, keep].gather(2, keep[:, None, :].expand(-1, nodes + 1, -1))  # [R, N + 1, N + 1]
    lineage = lineage & live[:, None, :] & live[:, :, None] | torch.eye(nodes + 1, dtype=torch.bool, device=device)
    structure = TreeStructure.on_device(parents, torch.where(live, grown.depths.gather(1, keep), 1), lineage, depth,
                                        width, sizes)
    packed = None if budget is None else r + min(budget, r * nodes)  # (at least sum(sizes): a host bound)
    tree = Tree(grown.tokens.gather(1, keep), parents, structure, None if budget is None else sizes, packed)
    return Draft(tree, torch.where(live, grown.fed_at.gather(1, keep), -1), feeds)
