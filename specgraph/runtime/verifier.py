"""The verifying stage: scores a draft tree in one forward pass and commits the accepted path."""

from __future__ import annotations

import torch

from specgraph.kernels import Kernels
from specgraph.recipe import SamplingSpec, VerifySpec
from specgraph.runtime.stage import Stage
from specgraph.tree import Tree
from specgraph.verify import Verdict, verify


class Verifier:
    """With L tokens committed, the stage's cache holds committed[:L - 1]; a tree's root is
    committed[L - 1], written at slot L - 1 with the tree after it."""

    def __init__(self, stage: Stage, spec: VerifySpec, rule: str, sampling: SamplingSpec,
                 kernels: Kernels = Kernels(), compile: bool = False):
        """`kernels`: the acceptance kernels' source; `compile`: build each step's placement with
        torch.compile (a few fused kernels, not a dozen small ones)."""
        self.stage = stage
        self.device = stage.device
        self.spec = spec.model_copy(update={"rule": rule})
        self.sampling = sampling
        self.kernels = kernels
        self._row = torch.zeros(1, dtype=torch.long, device=self.device)  # the request's row of the table
        if compile:
            self.placement = torch.compile(self.placement, fullgraph=True)

    @property
    def draws(self) -> bool:
        """Whether verification draws random numbers (then it needs a generator)."""
        return self.sampling.temperature > 0

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> None:
        """Feed all but the last prompt token [L] (the root of the first tree)."""
        self.stage.reset()
        if prompt.numel() > 1:
            self.stage.prefill(prompt[:-1])

    def score(self, tree: Tree, length: torch.Tensor, width: int) -> torch.Tensor:
        """The target's logits [N + 1, V] at every node of `tree` (root = the last of `length`
        committed tokens) over `width` cache slots."""
        return self.stage.forward_one(*self.placement(tree, length), width)

    def placement(self, tree: Tree, length: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The forward's tokens and positions [N + 1], region start [] and offsets [N + 1] and what
        each node sees [N + 1, N + 1]: the tree is written from the root's slot, in node order."""
        root = length - 1
        return tree.tokens, root + tree.depths, root, torch.arange(tree.size, device=self.device), tree.ancestors

    def verdict(self, tree: Tree, logits: torch.Tensor, generator: torch.Generator | None) -> Verdict:
        return verify(tree, logits, self.spec, self.sampling, generator, self.kernels)

    def commit(self, path: torch.Tensor, length: torch.Tensor) -> None:
        """Keep the accepted path (path [D + 1], root first, -1 padded): its K/V move to slots L - 1 + depth."""
        stage = self.stage
        stage.cache.commit(stage.table, self._row, path[None], (length - 1).reshape(1))
