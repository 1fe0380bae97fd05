"""Verification rules: given a draft tree and the target's logits at every node, decide the
accepted path and the bonus token.

- greedy: exact; accepts a child whose token is the target's argmax at its parent.
- sampling: lossless multi-candidate speculative sampling (SpecInfer/Sequoia): a node's children
  are tried in rank order; child c is accepted with probability min(1, p(x_c) / r_c(x_c)), where
  r_c is the distribution c was drawn from (`Tree.proposals`); each rejection replaces p by the
  normalised residual max(0, p - r_c). If no child is accepted the bonus is drawn from p.
- typical: lossy (Medusa's typical acceptance): a child is accepted when the target gives it more
  than min(threshold, alpha * exp(-entropy(p))); the bonus is drawn from p. Opt-in only.

Every rule is a fixed sequence of tensor operations (max_depth x max children steps), with no host
synchronisation: the verdict stays in device buffers until the executor reads it once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraph.kernels.accept import accept_greedy_reference
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


def _at(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """x[i] for a 0-dim index tensor, as a gather: indexing with it directly would read it on the host."""
    return x.index_select(0, i.reshape(1))[0]


def verify_greedy(tree: Tree, logits: torch.Tensor, accept=accept_greedy_reference) -> Verdict:
    """logits [N + 1, V]; `accept`: the acceptance kernel (see kernels/accept)."""
    best = logits.argmax(-1)  # [N + 1]
    return Verdict(*accept(tree.tokens, tree.parents, tree.ancestors, tree.depths, best, tree.max_depth))


def _walk(tree: Tree, probs: torch.Tensor, try_child) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk down from the root, at each node offering its children in rank order to
    `try_child(p, node, child) -> (accept [] bool, p after a rejection [V])`.
    Returns the path [D + 1], the stopping node [] and the distribution p [V] left there."""
    device = probs.device
    path = -(torch.arange(tree.max_depth + 1, device=device) > 0).long()  # [0, -1, ..., -1]
    node = torch.zeros((), dtype=torch.long, device=device)
    stopped = torch.zeros((), dtype=torch.bool, device=device)
    final = probs[0]
    for depth in range(tree.max_depth):
        p = _at(probs, node)
        chosen = torch.full((), -1, dtype=torch.long, device=device)
        for rank in range(tree.child_table.shape[1]):
            child = _at(tree.child_table[:, rank], node)
            live = (child >= 0) & ~stopped & (chosen < 0)
            accept, rejected_p = try_child(p, node, child.clamp(min=0))
            chosen = torch.where(live & accept, child, chosen)
            p = torch.where(live & ~accept, rejected_p, p)
        moved = chosen >= 0
        final = torch.where(~stopped & ~moved, p, final)  # where the walk stops, p is the bonus's law
        path[depth + 1] = torch.where(moved, chosen, -1)
        stopped = stopped | ~moved
        node = torch.where(moved, chosen, node)
    final = torch.where(stopped, final, _at(probs, node))  # reached a leaf at the deepest level
    return path, node, final


def verify_sampling(tree: Tree, logits: torch.Tensor, sampling: SamplingSpec,
                    generator: torch.Generator) -> Verdict:
    probs = probs_from_logits(logits, sampling)  # [N + 1, V]

    def try_child(p: torch.Tensor, node: torch.Tensor, child: torch.Tensor):
        token, proposal = _at(tree.tokens, child), _at(tree.proposals, child)  # [], [V]
        ratio = (_at(p, token) / _at(proposal, token)).clamp(max=1.0)
        accept = torch.rand((), generator=generator, device=p.device) < ratio
        residual = (p - proposal).clamp(min=0)
        total = residual.sum()
        # total is 0 only when p equals the proposal, where the ratio was 1 and nothing is rejected.
        return accept, torch.where(total > 0, residual / total.clamp(min=1e-30), p)

    path, _, final = _walk(tree, probs, try_child)
    return Verdict(path, torch.multinomial(final, 1, generator=generator)[0])


def verify_typical(tree: Tree, logits: torch.Tensor, sampling: SamplingSpec, spec: VerifySpec,
                   generator: torch.Generator) -> Verdict:
    probs = probs_from_logits(logits, sampling)  # [N + 1, V]
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)  # [N + 1]
    floor = torch.minimum(torch.full_like(entropy, spec.typical_threshold), spec.typical_alpha * torch.exp(-entropy))

    def try_child(p: torch.Tensor, node: torch.Tensor, child: torch.Tensor):
        return _at(_at(probs, node), _at(tree.tokens, child)) > _at(floor, node), p

    path, _, final = _walk(tree, probs, try_child)
    if sampling.temperature > 0:
        return Verdict(path, torch.multinomial(final, 1, generator=generator)[0])
    return Verdict(path, final.argmax())


def verify(tree: Tree, logits: torch.Tensor, spec: VerifySpec, sampling: SamplingSpec,
           generator: torch.Generator, accept_greedy=accept_greedy_reference) -> Verdict:
    if spec.rule == "greedy":
        return verify_greedy(tree, logits, accept_greedy)
    if spec.rule == "sampling":
        return verify_sampling(tree, logits, sampling, generator)
    return verify_typical(tree, logits, sampling, spec, generator)
