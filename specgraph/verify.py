"""Verification rules: given R draft trees and the target's logits at every node, decide each
tree's accepted path and bonus token.

- greedy: exact; accepts a child whose token is the target's argmax at its parent.
- sampling: lossless and drafter-invariant: the target's token at each node is its perturbed
  argmax, argmax_v(log p(v) + g(seed, t, v)) with t the sequence index it would take (sampling.py),
  and a child is accepted where it is that token (greedy's walk on those argmaxes). Each token
  follows p exactly and depends on the seed alone, so a request decodes the tokens the target
  alone samples with its seed, whatever drafted them.
- typical: lossy (Medusa's typical acceptance): a child is accepted when the target gives it more
  than min(threshold, alpha * exp(-entropy(p))); the bonus is drawn from p. Opt-in only.

The logits come packed, as the target's forward gave them ([T, V], `grid` [R, N + 1] each node's
row): greedy and sampling take the (perturbed) argmax of the packed rows before gathering. Every rule runs on the device
with no host synchronisation (greedy and sampling acceptance is one kernel, see kernels/accept;
typical is max_depth x max children steps of tensor operations): the verdict stays in device
buffers until the executor reads it once per step. Random numbers come from each request's own
stream or key (draws.py), so a request's verdicts do not depend on the batch it is in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraph.draws import Draws
from specgraph.kernels import Kernels
from specgraph.kernels.accept.reference import draw, rows_at, walk_tree
from specgraph.recipe import VerifySpec
from specgraph.sampling import SamplingRows, perturbed_top, probs_from_logits
from specgraph.tree import Tree


@dataclass
class Verdict:
    paths: torch.Tensor  # [R, D + 1] node indices: the root, then the accepted drafts by depth; -1 after them
    bonus: torch.Tensor  # [R] the target's own token after the last accepted node

    def accepted(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device: the counts [R] of new tokens (accepted drafts + the bonus) and the new tokens
        [R, D + 1] (the accepted drafts, then the bonus, then padding)."""
        drafts = self.paths[:, 1:]  # [R, D]
        counts = (drafts >= 0).sum(1) + 1
        new = torch.cat([tree.tokens.gather(1, drafts.clamp(min=0)), self.bonus[:, None]], 1)  # [R, D + 1]
        index = torch.arange(new.shape[1], device=new.device)
        return counts, torch.where(index == counts[:, None] - 1, self.bonus[:, None], new)


def verify(tree: Tree, logits: torch.Tensor, grid: torch.Tensor, spec: VerifySpec, sampling: SamplingRows,
           draws: Draws | None, kernels: Kernels = Kernels(), segments: torch.Tensor | None = None,
           positions: torch.Tensor | None = None) -> Verdict:
    """logits [T, V] packed; grid [R, N + 1]: the row of each tree node (-1: padding, never tried);
    `draws`: the requests' random streams (the typical rule); segments [T]: each
    packed row's request, positions [T]: the sequence index of the token its logits choose (the
    sampling rule)."""
    node = grid.clamp(min=0)
    index = torch.arange(tree.size, device=grid.device)
    tokens = torch.where(index < tree.counts()[:, None], tree.tokens, -1)  # padding matches nothing
    if spec.rule in ("greedy", "sampling"):
        if spec.rule == "greedy":
            best = logits.argmax(-1)  # [T]
        else:
            best = perturbed_top(logits, sampling.take(segments), positions, 1, kernels.perturbed_top)[0][:, 0]
        return Verdict(*kernels.accept_greedy(tokens, tree.parents, tree.ancestors, tree.depths, best[node],
                                              tree.max_depth))
    probs = probs_from_logits(logits[node], sampling)  # [R, N + 1, V]
    return verify_typical(tree, probs, spec, sampling, draws)


def verify_typical(tree: Tree, probs: torch.Tensor, spec: VerifySpec, sampling: SamplingRows,
                   draws: Draws | None) -> Verdict:
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(-1)  # [R, N + 1]
    floor = torch.minimum(torch.full_like(entropy, spec.typical_threshold), spec.typical_alpha * torch.exp(-entropy))

    def try_child(p: torch.Tensor, node: torch.Tensor, child: torch.Tensor, depth: int, rank: int):
        token = rows_at(tree.tokens, child)  # [R]
        return rows_at(probs, node).gather(1, token[:, None])[:, 0] > rows_at(floor, node), p

    paths, final = walk_tree(tree.child_table, probs, tree.max_depth, try_child)
    if draws is None:
        return Verdict(paths, final.argmax(1))
    sampled = draw(final, draws.uniform(1)[:, 0])
    return Verdict(paths, torch.where(sampling.temperature > 0, sampled, final.argmax(1)))
