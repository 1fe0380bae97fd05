"""The verifying stage: scores a draft tree in one forward pass and commits the accepted path."""

from __future__ import annotations

import torch

from specgraph.kernels import Kernels
from specgraph.recipe import SamplingSpec, VerifySpec
from specgraph.runtime.stage import Stage, step_mask
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
        if compile:
            self.placement = torch.compile(self.placement, fullgraph=True)

    @property
    def draws(self) -> bool:
        """Whether verification draws random numbers (then it needs a generator)."""
        return self.sampling.temperature > 0

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> None:
        """Feed all but the last prompt token [L] (the root of the first tree)."""
        self.stage.cache.reset()
        if prompt.numel() > 1:
            self.stage.prefill(prompt[:-1])

    def score(self, tree: Tree, length: torch.Tensor, width: int) -> torch.Tensor:
        """The target's logits [N + 1, V] at every node of `tree` (root = the last of `length`
        committed tokens) over `width` cache slots."""
        return self.stage.forward(*self.placement(tree, length, width))

    def placement(self, tree: Tree, length: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
        """The forward's tokens, positions and slots [N + 1] and mask [N + 1, width]: the tree is written from the root's slot."""
        root = length - 1
        slots = root + torch.arange(tree.size, device=self.device)
        return tree.tokens, root + tree.depths, slots, step_mask(root, tree.ancestors, width)

    def verdict(self, tree: Tree, logits: torch.Tensor, generator: torch.Generator | None) -> Verdict:
        return verify(tree, logits, self.spec, self.sampling, generator, self.kernels)

    def commit(self, path: torch.Tensor, length: torch.Tensor) -> None:
        """Keep the accepted path (path [D + 1], root first, -1 padded): its K/V move to slots L - 1 + depth."""
        self.stage.cache.commit(path, length - 1)
