"""Verification rules: given a draft tree and the target's logits at every node, decide the
accepted path and the bonus token.

- greedy: exact; accepts a child whose token is the target's argmax at its parent.
- sampling: lossless multi-candidate speculative sampling (SpecInfer/Sequoia): a node's children
  are tried in rank order; child c is accepted with probability min(1, p(x_c) / r_c(x_c)), where
  r_c is the distribution c was drawn from (`Tree.proposals`); each rejection replaces p by the
  normalised residual max(0, p - r_c). If no child is accepted the bonus is drawn from p.
- typical: lossy (Medusa's typical acceptance): a child is accepted when the target gives it more
  than min(threshold, alpha * exp(-entropy(p))); the bonus is drawn from p. Opt-in only.

Every rule runs on the device with no host synchronisation (greedy and sampling acceptance are
kernels, see kernels/accept; typical is max_depth x max children steps of tensor operations): the
verdict stays in device buffers until the executor reads it once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraph.kernels import Kernels
from specgraph.kernels.accept import accept_greedy_reference, accept_sampling_reference
from specgraph.kernels.accept.reference import at, walk_tree
from specgraph.recipe import SamplingSpec, VerifySpec
from specgraph.sampling import probs_from_logits
from specgraph.tree import Tree


@dataclass
class Verdict:
    path: torch.Tensor  # [D + 1] node indices: the root, then the accepted drafts by depth; -1 after them
    bonus: torch.Tensor  # [] the target's own token after the last accepted node

    def accepted(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device: the count [] of new tokens (accepted drafts + the bonus) and the new tokens
        [D + 1] (the accepted drafts, then the bonus, then padding)."""
        drafts = self.path[1:]  # [D]
        count = (drafts >= 0).sum() + 1
        new = torch.cat([tree.tokens.index_select(0, drafts.clamp(min=0)), self.bonus.reshape(1)])  # [D + 1]
        index = torch.arange(new.numel(), device=new.device)
        return count, torch.where(index == count - 1, self.bonus, new)


def verify_greedy(tree: Tree, logits: torch.Tensor, accept=accept_greedy_reference) -> Verdict:
    """logits [N + 1, V]; `accept`: the acceptance kernel (see kernels/accept)."""
    best = logits.argmax(-1)  # [N + 1]
    return Verdict(*accept(tree.tokens, tree.parents, tree.ancestors, tree.depths, best, tree.max_depth))


def verify_sampling(tree: Tree, logits: torch.Tensor, sampling: SamplingSpec, generator: torch.Generator,
                    accept=accept_sampling_reference) -> Verdict:
    """logits [N + 1, V]; `accept`: the acceptance kernel, given one uniform per try and one for the bonus."""
    probs = probs_from_logits(logits.float(), sampling)  # [N + 1, V]
    uniforms = torch.rand(tree.max_depth * tree.child_table.shape[1] + 1, generator=generator, device=logits.device)
    if tree.proposals is None:  # the root alone (plain sampling): no child is tried, the bonus is drawn from p
        assert tree.size == 1, "a drafted tree carries the distributions its nodes were drawn from"
        proposals = probs
    else:
        proposals = tree.proposals.float()
    return Verdict(*accept(tree.tokens, tree.child_table, probs, proposals, uniforms, tree.max_depth))


def verify_typical(tree: Tree, logits: torch.Tensor, sampling: SamplingSpec, spec: VerifySpec,
                   generator: torch.Generator) -> Verdict:
    probs = probs_from_logits(logits, sampling)  # [N + 1, V]
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)  # [N + 1]
    floor = torch.minimum(torch.full_like(entropy, spec.typical_threshold), spec.typical_alpha * torch.exp(-entropy))

    def try_child(p: torch.Tensor, node: torch.Tensor, child: torch.Tensor, depth: int, rank: int):
        return at(at(probs, node), at(tree.tokens, child)) > at(floor, node), p

    path, final = walk_tree(tree.child_table, probs, tree.max_depth, try_child)
    if sampling.temperature > 0:
        return Verdict(path, torch.multinomial(final, 1, generator=generator)[0])
    return Verdict(path, final.argmax())


def verify(tree: Tree, logits: torch.Tensor, spec: VerifySpec, sampling: SamplingSpec,
           generator: torch.Generator, kernels: Kernels = Kernels()) -> Verdict:
    """`kernels`: where the acceptance kernels come from (accept_greedy, accept_sampling)."""
    if spec.rule == "greedy":
        return verify_greedy(tree, logits, kernels.accept_greedy)
    if spec.rule == "sampling":
        return verify_sampling(tree, logits, sampling, generator, kernels.accept_sampling)
    return verify_typical(tree, logits, sampling, spec, generator)
