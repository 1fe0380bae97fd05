"""The verifying stage: scores R requests' draft trees in one forward pass and commits each one's accepted path."""

from __future__ import annotations

import torch

from specgraph.draws import Draws
from specgraph.kernels import Kernels
from specgraph.layout import Layout
from specgraph.recipe import VerifySpec
from specgraph.runtime.stage import Stage
from specgraph.sampling import SamplingRows, forbid_stops
from specgraph.tree import Tree
from specgraph.verify import Verdict, verify


class Verifier:
    """With L tokens of a request committed, the stage's cache holds committed[:L - 1]; its tree's
    root is committed[L - 1], written at virtual slot L - 1 with the tree after it, in node order."""

    def __init__(self, stage: Stage, spec: VerifySpec, rule: str, kernels: Kernels = Kernels(), compile: bool = False):
        """`kernels`: the acceptance kernels' source; `compile`: build each step's layout with
        torch.compile (a few fused kernels, not a dozen small ones)."""
        self.stage = stage
        self.device = stage.device
        self.spec = spec.model_copy(update={"rule": rule})
        self.kernels = kernels
        if compile:
            self.placement = torch.compile(self.placement, fullgraph=True)

    @property
    def draws(self) -> bool:
        """Whether verification draws from each request's stream (the typical rule)."""
        return self.spec.rule == "typical"

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor | None:
        """A new request in table row 0: feed all but the last prompt token [L] (the root of the first
        tree) -> where the stage hands features over (an EAGLE-3 head drafts for it), theirs [L - 1, C H]
        (None for a one-token prompt, which has none)."""
        self.stage.reset()
        if prompt.numel() == 1:
            return None
        if not self.stage.capture:
            self.stage.prefill(prompt[:-1])
            return None
        return self.stage.prefill_features(prompt[:-1])

    def score(self, tree: Tree, rows: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, Layout]:
        """The target's logits [T, V] at every node of the trees of the requests in table rows `rows`
        [R] (root = the last of each one's `lengths` [R] committed tokens), packed, over `width`
        virtual slots, and their layout (its grid: each tree node's row)."""
        tokens, layout = self.placement(tree, rows, lengths, width)
        return self.stage.forward(tokens, layout), layout

    def score_features(self, tree: Tree, rows: torch.Tensor, lengths: torch.Tensor, width: int
                       ) -> tuple[torch.Tensor, torch.Tensor, Layout]:
        """`score`, with the features of every node [T, C H] that the stage's `capture` names (a head drafts from them)."""
        tokens, layout = self.placement(tree, rows, lengths, width)
        logits, features = self.stage.forward_features(tokens, layout)
        return logits, features, layout

    def placement(self, tree: Tree, rows: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, Layout]:
        """Each tree written from its root's slot, in node order, each node seeing its ancestors."""
        starts = lengths - 1
        offsets = torch.arange(tree.size, device=self.device).expand(tree.rows, -1)
        return self.stage.pack(tree.tokens, starts[:, None] + tree.depths, rows, starts, offsets, tree.ancestors,
                               width, tree.sizes, tree.packed)

    def verdict(self, tree: Tree, logits: torch.Tensor, layout: Layout, sampling: SamplingRows | None,
                draws: Draws | None) -> Verdict:
        """The verdict on the trees from their logits [T, V]; where `sampling` is given, no request's
        stop token is chosen before its min_length (the token a node's logits choose sits one past it)."""
        segments, positions = layout.token_segments(), layout.positions + 1  # [T] each
        if sampling is not None and sampling.forbids:
            logits = forbid_stops(logits, sampling.take(segments), positions)
        return verify(tree, logits, layout.grid[:, : tree.size], self.spec, sampling, draws, self.kernels, segments,
                      positions)

    def commit(self, paths: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Keep each request's accepted path (paths [R, D + 1], root first, -1 padded): its K/V move to
        slots L - 1 + depth, L = its committed count `lengths` [R] before the step."""
        self.stage.cache.commit(self.stage.table, rows, paths, lengths - 1)
