"""Drafting with an EAGLE-3 head (models/eagle.py): the Drafter's trees, grown from the target's features.

A head's cache holds pairs, not tokens: the pair at head slot p is (the target's features at
committed token p, token p + 1), at rotary position p. With L tokens committed the target has
handed over the features of committed[:L - 1] (the last, the root, has been through no forward
yet), so the pairs at slots [0, L - 1) are known: the last, (features at L - 2, the root), gives
the root's children. The head's cache holds the pairs but the last `feeds` (those of the tokens
the last step committed, whose features that step's verification produced); each draft's
catch-up feeds those, causally, from their slots. A tree node is fed as (the head's own output at
its parent, its token), at head-cache slots L - 1 + feed offset and position L - 2 + depth,
seeing the committed pairs and its fed ancestors.

Unlike a model drafter's, a tree's K/V are never kept: the accepted tokens come back with the
target's features and the next catch-up feeds them (EAGLE's own order), so `commit` has nothing
to move.
"""

from __future__ import annotations

import torch

from specgraph.draft import Draft, Drafter, Requests
from specgraph.recipe import DynamicTree
from specgraph.runtime.stage import Stage, packed_order
from specgraph.sampling import SamplingRows
from specgraph.tree import TreeTopology


class HeadDrafter(Drafter):
    def __init__(self, stage: Stage, tree: TreeTopology | DynamicTree, rule: str, max_feeds: int | None = None):
        """A catch-up feeds up to a step's new tokens: the accepted path and the bonus (D + 1), or
        `max_feeds` where a deeper tree's steps feed this one's (the shallower modes of a policy)."""
        depth = tree.depth if isinstance(tree, DynamicTree) else tree.max_depth
        super().__init__(stage, tree, rule, max_feeds=max_feeds or depth + 1)
        self.span = max(self.span, self.max_feeds)  # (a catch-up's padding columns are written past the pairs)
        self.head = stage.model

    @property
    def feature_width(self) -> int:
        """C H: the width of the target's features it reads."""
        return self.head.fc.in_features

    def _forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                 starts: torch.Tensor, offsets: torch.Tensor, visible: torch.Tensor, width: int, logits: bool = True,
                 counts: torch.Tensor | None = None, total: int | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Stage.forward_rows for a head: tokens [R, E] with their hidden inputs [R, E, H] (only each
        row's first counts[r] where given: Stage.pack) -> logits [R, E, V] (None where not `logits`)
        and outputs [R, E, H]."""
        r, e = tokens.shape
        packed, layout = self.stage.pack(tokens, positions, rows, starts, offsets, visible, width, counts, total)
        hidden = hidden.flatten(0, 1)
        if counts is not None:  # (in the packed tokens' order)
            hidden = hidden.index_select(0, packed_order(counts, e, total))
        scores, out = self.head(packed[None], hidden[None], self.stage.cache, layout, logits)
        index = layout.grid[:, :e].clamp(min=0).flatten()
        out = out[0].index_select(0, index).view(r, e, -1)
        return (None if scores is None else scores[0].index_select(0, index).view(r, e, -1)), out

    @torch.inference_mode()
    def prompt_pairs(self, rows: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, starts: torch.Tensor,
                     pairs: torch.Tensor, width: int, total: int) -> None:
        """Chunks of R prompts in one forward, each kept: table rows, starts, pairs [R] (a chunk's first
        committed token, and the pairs it completes), features [R, E, C H] at the chunk's tokens, tokens
        [R, E] the tokens after them; row r feeds its first pairs[r] pairs at head slots starts[r]..,
        over `width` virtual slots, at most `total` pairs in all (a host bound: Stage.pack)."""
        r, e = tokens.shape
        offsets = torch.arange(e, device=tokens.device)
        causal = torch.ones(e, e, dtype=torch.bool, device=tokens.device).tril()
        self._forward(tokens, self.head.fuse(features), starts[:, None] + offsets, rows, starts, offsets.expand(r, -1),
                      causal.expand(r, -1, -1), width, False, pairs, total)
        self.stage.cache.keep(rows, pairs)

    def prompt_chunks(self, rows: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, starts: torch.Tensor,
                      stops: torch.Tensor, lengths: torch.Tensor, width: int, total: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunks of the target's prompt forwards, one a row: table rows, starts, stops, lengths [R] (each
        chunk's committed tokens start..stop of a prompt of `lengths` tokens), tokens [rows, capacity]
        (each row's committed tokens), features [R, E, C H] at the chunk's tokens; feed the pairs each
        chunk completes, those of tokens below its length - 2 (prompt_pairs: `width`, `total`) -> the
        features at token length - 2 [R, C H] and whether the chunk holds them [R]: the root's pair,
        which the first catch-up feeds."""
        e = features.shape[1]
        offsets = torch.arange(e, device=features.device)
        last = lengths - 2 - starts  # [R] the column of the root's pair
        pairs = torch.minimum(stops - starts, last).clamp(min=0)  # [R] those each chunk completes
        after = tokens[rows[:, None], (starts[:, None] + 1 + offsets).clamp(max=tokens.shape[1] - 1)]  # [R, E]
        self.prompt_pairs(rows, after, features, starts, pairs, width, total)
        root = features.gather(1, last.clamp(0, e - 1)[:, None, None].expand(-1, 1, features.shape[-1]))[:, 0]
        return root, (last >= 0) & (last < stops - starts)

    @torch.inference_mode()
    def feed(self, requests: Requests, width: int) -> None:
        """Feed each request's pending pairs and draft nothing: a plain step's share of the head's
        work, once the pairs of the plain steps before it fill `requests.features` (runner.py), one
        pass of its layer without its vocabulary projection."""
        self._catch_up(requests, width, logits=False)

    def _catch_up(self, requests: Requests, width: int, logits: bool = True
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Feed each request's last feeds[r] pairs -> the roots' logits [R, V] and the head's outputs
        at the roots [R, H]. Every request feeds max_feeds columns: those past its feeds[r] are
        padding, written past its pairs (where its tree goes) and seen by none of its pairs."""
        e, feeds, device = requests.max_feeds, requests.feeds, requests.rows.device
        columns = torch.arange(e, device=device)
        starts = (requests.lengths - 1 - feeds).clamp(min=0)  # [R] (clamped: the padding row's)
        slots = starts[:, None] + columns  # [R, E]
        tokens = requests.tokens[requests.rows[:, None], (slots + 1).clamp(max=requests.tokens.shape[1] - 1)]
        causal = torch.ones(e, e, dtype=torch.bool, device=device).tril()
        scores, out = self._forward(tokens, self.head.fuse(requests.features), slots, requests.rows, starts,
                                    columns.expand(requests.size, -1), causal.expand(requests.size, -1, -1), width,
                                    logits)
        if scores is None:
            return None, None
        last = (feeds - 1).clamp(min=0)[:, None, None]  # (no pair yet, a one-token prompt: a draft of padding)
        return (scores.gather(1, last.expand(-1, 1, scores.shape[-1]))[:, 0],
                out.gather(1, last.expand(-1, 1, out.shape[-1]))[:, 0])

    @torch.inference_mode()
    def draft(self, requests: Requests, width: int, sampling: SamplingRows | None = None,
              budget: int | None = None, live: torch.Tensor | None = None) -> Draft:
        """Drafter.draft from the pairs of `requests.features` (see the module doc)."""
        root_logits, root_out = self._catch_up(requests, width)  # [R, V], [R, H]
        r, h = root_out.shape
        outputs = root_out.new_zeros(r, 1 + self.span, h)  # [R, 1 + S]: the root's output, then each fed node's
        outputs[:, 0] = root_out
        lengths, device = requests.lengths, root_out.device

        def feed(tokens, depths, lineage, sources, new):
            f = tokens.shape[1]
            fresh = torch.arange(f - new, f, device=device)  # [new] their feed offsets
            inputs = outputs.gather(1, (sources[:, -new:] + 1)[..., None].expand(-1, -1, h))  # [R, new, H]: parents'
            logits, out = self._forward(tokens[:, -new:], inputs, lengths[:, None] - 2 + depths[:, -new:],
                                        requests.rows, lengths - 1, fresh.expand(r, -1), lineage[:, -new:], width)
            outputs.index_copy_(1, 1 + fresh, out)
            return logits

        return self._grow(root_logits, requests, feed, sampling, budget, live)

    def commit(self, draft: Draft, paths: torch.Tensor, requests: Requests) -> None:
        """Nothing to move: the next catch-up feeds the accepted tokens with the target's features."""
