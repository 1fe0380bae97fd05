"""The serial executor: draft, then verify, in lockstep on one host thread.

It is the baseline every other executor is measured against, and with no drafter it is plain
autoregressive decoding through the same path (a root-only tree per step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specgraph.draft import Drafter
from specgraph.recipe import SamplingSpec, VerifySpec
from specgraph.runtime.stage import Stage
from specgraph.tree import Tree, prefix_tree_mask
from specgraph.verify import Verdict, verify


@dataclass
class Generation:
    output_ids: list[int]  # new tokens only, ending at the first end-of-sequence token if one came
    target_steps: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # per target step: accepted drafts + bonus
    seconds: float = 0.0
    first_token_seconds: float = 0.0  # prompt in, first step's tokens out
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


class Verifier:
    """The target stage: scores a draft tree in one forward pass and commits the accepted path."""

    def __init__(self, stage: Stage, spec: VerifySpec, rule: str, sampling: SamplingSpec):
        self.stage = stage
        self.device = stage.device
        self.spec = spec.model_copy(update={"rule": rule})
        self.sampling = sampling

    @torch.inference_mode()
    def step(self, committed: torch.Tensor, tree: Tree, generator: torch.Generator) -> Verdict:
        """committed [L]: the target's cache holds committed[:-1]; tree is rooted at committed[-1]."""
        self.stage.catch_up(committed[:-1])
        prefix = self.stage.cache.length
        mask = None if tree.size == 1 else prefix_tree_mask(prefix, tree.ancestors)  # [N+1, prefix+N+1]
        logits = self.stage.forward(tree.tokens, prefix + tree.depths, prefix, mask)  # [N + 1, V]
        return verify(tree, logits, self.spec, self.sampling, generator)

    def commit(self, path: list[int]) -> None:
        """Keep the K/V of the accepted path (root first), written at the tree's slots."""
        prefix = self.stage.cache.length
        self.stage.cache.commit(torch.tensor(path, device=self.device) + prefix)


class SerialExecutor:
    def __init__(self, verifier: Verifier, drafter: Drafter | None, eos_ids: tuple[int, ...], max_seq_len: int):
        self.verifier, self.drafter = verifier, drafter
        self.eos_ids = tuple(eos_ids)
        self.max_seq_len = max_seq_len
        self.device = verifier.stage.device

    def _reset(self) -> None:
        self.verifier.stage.cache.reset()
        if self.drafter is not None:
            self.drafter.stage.cache.reset()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self._reset()
        generator = torch.Generator(self.device).manual_seed(seed)  # verification's draws
        draft_generator = None  # the drafter's draws, on its own device
        if self.drafter is not None:
            draft_generator = torch.Generator(self.drafter.stage.device).manual_seed(seed + 1)
        committed = torch.tensor(prompt_ids, device=self.device)  # [L]
        budget = min(max_new_tokens, self.max_seq_len - len(prompt_ids))
        out = Generation(output_ids=[])
        start = time.perf_counter()
        while len(out.output_ids) < budget:
            t0 = time.perf_counter()
            if self.drafter is None:
                tree = Tree.root_only(int(committed[-1]), self.device)
            else:
                tree = self.drafter.draft(committed.to(self.drafter.stage.device), draft_generator).to(self.device)
            t1 = time.perf_counter()
            path, new = self.verifier.step(committed, tree, generator).read(tree)  # the step's one host read
            self.verifier.commit(path)
            if self.drafter is not None:
                self.drafter.commit(path)
            out.draft_seconds += t1 - t0
            out.verify_seconds += time.perf_counter() - t1
            out.target_steps += 1
            out.accepted_lengths.append(len(new))
            new = new[: budget - len(out.output_ids)]
            hit_eos = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
            if hit_eos is not None:
                new = new[: hit_eos + 1]
            out.output_ids.extend(new)
            if out.target_steps == 1:
                out.first_token_seconds = time.perf_counter() - start
            committed = torch.cat([committed, torch.tensor(new, device=self.device)])
            if hit_eos is not None:
                break
        out.seconds = time.perf_counter() - start
        return out
