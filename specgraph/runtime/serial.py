"""The serial executor: draft, then verify, in lockstep on one host thread.

Decoding state lives on the device (`Sequence`), and a step is two phases that read and write
only device tensors:
  draft   - the drafter's catch-up and tree growth (no host reads);
  verify  - the target scores the tree, the rule picks the path and bonus, both caches move the
            accepted K/V into place and the new tokens are appended.
The host reads once per step: the number of new tokens and the tokens. When every phase is a
fixed sequence of device operations on one GPU (the capture_graphs pass decides), each is
captured as one CUDA graph and a step is two replays. With no drafter it is plain
autoregressive decoding through the same path (a root-only tree).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from specgraph.draft import CATCH_UP, Draft, Drafter
from specgraph.runtime.clock import Clock
from specgraph.runtime.executor import Generation, Output
from specgraph.runtime.sequence import Sequence
from specgraph.runtime.graphs import Replays
from specgraph.runtime.verifier import Verifier
from specgraph.tree import Tree, TreeStructure


class SerialExecutor:
    def __init__(self, verifier: Verifier, drafter: Drafter | None, eos_ids: tuple[int, ...], max_seq_len: int,
                 step_graphs: bool = False, compile: bool = False):
        """`step_graphs`: capture each phase as a CUDA graph (the plan's decision: every stage on the
        target's GPU with static shapes, no draws). `compile`: run what follows the target's forward
        (verdict, commits, append) through torch.compile where it has no draws, a few fused kernels
        instead of some twenty."""
        self.verifier, self.drafter = verifier, drafter
        self.eos_ids = tuple(eos_ids)
        self.max_seq_len = max_seq_len
        self.device = verifier.device
        self.nodes = drafter.nodes if drafter is not None else 0
        capacity = max_seq_len + self.nodes + 1  # a step appends at most N + 1 tokens
        self.sequence = Sequence(capacity, self.device)
        self._draft_sequence = self.sequence
        if drafter is not None and drafter.stage.device != self.device:
            self._draft_sequence = Sequence(capacity, drafter.stage.device)
        self._root, self._root_parents = TreeStructure.of([-1], self.device), torch.tensor([-1], device=self.device)
        stages = [verifier.stage] + ([drafter.stage] if drafter is not None else [])
        if step_graphs and not all(s.static_shapes and s.device == self.device for s in stages):
            raise ValueError("step graphs need every stage on the target's device with static shapes")
        assert not (step_graphs and verifier.draws), "a step that draws is not captured"
        self.step_graphs = step_graphs
        self._replays = Replays(step_graphs, verifier.stage.pool)
        self.max_step_tokens = 1 + (drafter.max_depth if drafter is not None else 0)  # accepted drafts + bonus
        self.lookahead = self.device.type == "cuda"  # enqueue the next step before reading this one
        pinned = self.device.type == "cuda"  # landing buffers on the host for two steps in flight
        self._host = [torch.empty(1 + self.max_step_tokens, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._flip = 0
        if compile and not verifier.draws:
            self._settle = torch.compile(self._settle, fullgraph=True)

    def _draft(self, length: int, generator: torch.Generator | None) -> Draft:
        seq = self._draft_sequence
        if seq is not self.sequence:
            seq.copy_(self.sequence)
        width = self.drafter.stage.width(length, self.nodes + 1)
        draft = self.drafter.draft(seq.tokens, seq.length, width, generator, min(CATCH_UP, length))
        return dataclasses.replace(draft, tree=draft.tree.to(self.device))

    def _verify(self, draft: Draft | None, length: int, generator: torch.Generator | None) -> torch.Tensor:
        """-> [D + 2]: the count of new tokens, then the new tokens (padded)."""
        tree = self._root_tree() if draft is None else draft.tree
        width = self.verifier.stage.width(length, self.nodes + 1)
        return self._settle(tree, draft, self.verifier.score(tree, self.sequence.length, width), generator)

    def _settle(self, tree: Tree, draft: Draft | None, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """What follows the target's forward: the verdict on `tree` from its logits [N + 1, V], both
        caches' commits and the append -> [D + 2] (see `_verify`)."""
        seq = self.sequence
        verdict = self.verifier.verdict(tree, logits, generator)
        count, new = verdict.accepted(tree)
        self.verifier.commit(verdict.path, seq.length)
        if draft is not None:
            self.drafter.commit(draft, verdict.path.to(self.drafter.stage.device), self._draft_sequence.length)
        seq.append(new, count)
        return torch.cat([count[None], new])

    def _root_tree(self) -> Tree:
        """The autoregressive step's tree: the last committed token alone."""
        tokens = self.sequence.tokens.index_select(0, self.sequence.length.reshape(1) - 1)  # [1]
        return Tree(tokens, self._root_parents, None, self._root)

    def _step(self, length: int, generators: tuple, clock: Clock) -> torch.Tensor:
        """One step from device state -> [D + 2] (see `_verify`); `length` (host) sizes eager forwards
        and the first catch-up (a one-token prompt's feeds one token: that step is not captured)."""
        draft_generator, generator = generators
        clock.mark()
        if not (self.step_graphs and length >= CATCH_UP):
            draft = None if self.drafter is None else self._draft(length, draft_generator)
            clock.mark()
            return self._verify(draft, length, generator)
        if self.drafter is None:
            clock.mark()
            return self._replays.run("verify", lambda: self._verify(None, length, None))
        outputs = self._replays.run("draft", lambda: self._draft(length, None).tensors())
        clock.mark()
        depth = self.drafter.max_depth
        return self._replays.run("verify", lambda *t: self._verify(Draft.from_tensors(t, depth), length, None),
                                 *outputs)

    def _launch(self, length: int, generators: tuple) -> tuple[torch.Tensor, torch.cuda.Event | None, Clock]:
        """Enqueue one step and the copy of its result to the host; returns (host copy, its event, clock)."""
        clock = Clock(self.device)
        result = self._step(length, generators, clock)  # [D + 2], D this step's tree depth
        clock.mark()
        if not self.lookahead:
            return result, None, clock
        host = self._host[self._flip][: result.numel()]
        self._flip ^= 1
        host.copy_(result, non_blocking=True)  # before the next step's replay overwrites `result`
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return host, done, clock

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        """On a GPU the next step is enqueued before this step's result is read (when this step
        cannot use up the budget), so the GPU does not wait for the host's bookkeeping; a step
        past an end-of-sequence token is discarded."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        start = time.perf_counter()
        generator = torch.Generator(self.device).manual_seed(seed)  # verification's draws
        draft_generator = None  # the drafter's draws, on its own device
        prompt = torch.tensor(prompt_ids, device=self.device)  # [L]
        self.sequence.start(prompt)
        self.verifier.prefill(prompt)
        if self.drafter is not None:
            draft_generator = torch.Generator(self.drafter.stage.device).manual_seed(seed + 1)
            self.drafter.prefill(prompt.to(self.drafter.stage.device))
        generators = (draft_generator, generator)
        length = len(prompt_ids)
        out = Generation(output_ids=[])
        output = Output(out, length, max_new_tokens, self.max_seq_len, self.eos_ids)
        pending = self._launch(length, generators) if output.room > 0 else None
        while pending is not None:
            ahead = None
            if self.lookahead and output.room > self.max_step_tokens:
                ahead = self._launch(length + self.max_step_tokens, generators)  # length: an upper bound
            result, done, clock = pending
            if done is not None:
                done.synchronize()
            count, *new = result.tolist()  # the step's one host read
            draft_s, verify_s = clock.seconds()
            out.draft_seconds += draft_s
            out.verify_seconds += verify_s
            out.target_steps += 1
            length += count
            finished = output.take(new[:count])
            if out.target_steps == 1:
                out.first_token_seconds = time.perf_counter() - start
            if finished:
                break
            pending = ahead or self._launch(length, generators)
        out.seconds = time.perf_counter() - start
        return out
