"""Verification rules: given a draft tree and the target's logits at every node, decide the
accepted path and the bonus token.

- greedy: exact; accepts a child whose token is the target's argmax at its parent.
- sampling: lossless multi-candidate speculative sampling (SpecInfer/Sequoia): a node's children
  are tried in rank order; child c is accepted with probability min(1, p(x_c) / r_c(x_c)), where
  r_c is the distribution c was drawn from (`Tree.proposals`); each rejection replaces p by the
  normalised residual max(0, p - r_c). If no child is accepted the bonus is drawn from p.
- typical: lossy (Medusa's typical acceptance): a child is accepted when the target gives it more
  than min(threshold, alpha * exp(-entropy(p))); the bonus is drawn from p. Opt-in only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraph.recipe import SamplingSpec, VerifySpec
from specgraph.sampling import probs_from_logits, sample
from specgraph.tree import Tree


@dataclass
class Verdict:
    path: torch.Tensor  # [A + 1] node indices, root first, then the accepted drafts by depth
    bonus: int  # the target's own token after the last accepted node

    def new_tokens(self, tree: Tree) -> list[int]:
        """Tokens this step commits: accepted drafts + the bonus."""
        return [*tree.tokens[self.path[1:]].tolist(), self.bonus]


def verify_greedy(tree: Tree, logits: torch.Tensor) -> Verdict:
    """logits [N + 1, V]. Tensor ops only; siblings carry distinct tokens, so at most one matches."""
    best = logits.argmax(-1)  # [N + 1]
    matches = tree.tokens == best[tree.parents.clamp(min=0)]  # [N + 1]
    matches[0] = True
    ancestors = tree.ancestors  # [N + 1, N + 1]
    on_path = ~(ancestors & ~matches[None, :]).any(-1)  # node and all its ancestors matched
    depth = ancestors.sum(-1) - 1
    last = torch.where(on_path, depth, -1).argmax()
    path = ancestors[last].nonzero().flatten()  # ascending index = ascending depth (topological order)
    return Verdict(path, int(best[last]))


def verify_sampling(tree: Tree, logits: torch.Tensor, sampling: SamplingSpec,
                    generator: torch.Generator) -> Verdict:
    probs = probs_from_logits(logits, sampling)  # [N + 1, V]
    path, node = [0], 0
    while True:
        p = probs[node]
        for child in tree.children(node):
            token, proposal = int(tree.tokens[child]), tree.proposals[child]
            ratio = (p[token] / proposal[token]).clamp(max=1.0)
            if torch.rand((), generator=generator, device=p.device) < ratio:
                break
            residual = (p - proposal).clamp(min=0)
            total = residual.sum()
            # total is 0 only when p equals the proposal, where the ratio above was 1.
            p = residual / total if total > 0 else p
        else:
            return Verdict(torch.tensor(path, device=logits.device), sample(p, generator))
        path.append(child)
        node = child


def verify_typical(tree: Tree, logits: torch.Tensor, sampling: SamplingSpec, spec: VerifySpec,
                   generator: torch.Generator) -> Verdict:
    probs = probs_from_logits(logits, sampling)  # [N + 1, V]
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)  # [N + 1]
    floor = torch.minimum(torch.full_like(entropy, spec.typical_threshold),
                          spec.typical_alpha * torch.exp(-entropy))
    path, node = [0], 0
    while True:
        passing = [c for c in tree.children(node) if probs[node, tree.tokens[c]] > floor[node]]
        if not passing:
            bonus = sample(probs[node], generator) if sampling.temperature > 0 else int(probs[node].argmax())
            return Verdict(torch.tensor(path, device=logits.device), bonus)
        node = passing[0]
        path.append(node)


def verify(tree: Tree, logits: torch.Tensor, spec: VerifySpec, sampling: SamplingSpec,
           generator: torch.Generator) -> Verdict:
    if spec.rule == "greedy":
        return verify_greedy(tree, logits)
    if spec.rule == "sampling":
        return verify_sampling(tree, logits, sampling, generator)
    return verify_typical(tree, logits, sampling, spec, generator)
