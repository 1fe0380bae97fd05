"""The device side of an engine: every request slot's committed tokens, sampling settings and
random stream, the stages' block tables, and the batched work of a step.

A decoding step over R requests is two phases that read and write only device tensors:
  draft   - every request's catch-up and tree growth, one forward per tree level for all of them;
  verify  - the target scores the concatenation of all trees in one forward (ragged where a
            budget sizes them), the rule picks each request's path and bonus, both caches move the
            accepted K/V into place and the new tokens are appended.
The host reads once per step: each request's count of new tokens and the tokens. With no drafter
it is plain autoregressive decoding through the same path (root-only trees).

Slot `slots` (one past the last request slot) is the padding row a step may add to reach a
captured size: its table row points at the trash block, and its committed length is put back
after every step, so whatever it computes stays there.
"""

from __future__ import annotations

import torch

from specgraph.draft import Draft, Drafter, Requests
from specgraph.draws import Draws
from specgraph.layout import Layout
from specgraph.head import HeadDrafter
from specgraph.recipe import SamplingSpec
from specgraph.runtime.clock import Clock
from specgraph.runtime.graphs import Replays
from specgraph.runtime.stage import Stage
from specgraph.runtime.verifier import Verifier
from specgraph.sampling import SamplingRows, stopping
from specgraph.tree import CATCH_UP, Tree, TreeStructure


class Runner:
    def __init__(self, verifier: Verifier, drafter: Drafter | None, slots: int, capacity: int, compile: bool = False,
                 captured: bool = False):
        """`slots`: request slots (rows of the stages' tables, less the padding row); `capacity`:
        committed tokens a request may reach, and a step's worth past them; `compile`: run what
        follows the target's forward (verdicts, commits, append) through torch.compile where it
        draws nothing, a few fused kernels instead of some twenty; `captured`: each step's phases
        replay CUDA graphs, one per batch size of `sizes` (powers of two, and `slots`)."""
        self.verifier, self.drafter = verifier, drafter
        self.device = verifier.device
        self.stages = [verifier.stage] + ([drafter.stage] if drafter is not None else [])
        self.padding = slots
        rows = slots + 1
        self.tokens = torch.zeros(rows, capacity, dtype=torch.long, device=self.device)  # [rows, capacity]
        self.lengths = torch.full((rows,), CATCH_UP, dtype=torch.long, device=self.device)  # [rows]
        self.host_lengths = [CATCH_UP] * rows
        self.sampling = SamplingRows.of([SamplingSpec()] * rows, self.device)
        self.draws = Draws(torch.zeros(rows, dtype=torch.long, device=self.device),
                           torch.zeros(rows, dtype=torch.long, device=self.device))
        self._root = TreeStructure.of([-1], self.device)
        self.features = self.pending = None  # a head's (head.py): the target's features of each row's pending pairs
        if isinstance(drafter, HeadDrafter):
            dtype = verifier.stage.model.embed_tokens.weight.dtype
            self.features = torch.zeros(rows, drafter.max_feeds, drafter.feature_width, dtype=dtype,
                                        device=self.device)  # [rows, D + 1, C H]
            self.pending = torch.zeros(rows, dtype=torch.long, device=self.device)  # [rows] pairs not fed to the head
        self.captured = captured
        self.sizes = sorted({min(1 << k, slots) for k in range(slots.bit_length() + 1)})
        self._replays = Replays(captured, verifier.stage.pool)
        for stage in self.stages:
            stage.table[self.padding].zero_()
        if compile and not verifier.draws:
            self._settle = torch.compile(self._settle, fullgraph=True)

    # -- a request's slot
    def start(self, slot: int, blocks: list[int], prompt: list[int], sampling: SamplingSpec,
              stops: tuple[int, ...] = (), min_tokens: int = 0) -> None:
        """A request takes `slot`: its blocks in every stage's table, its prompt committed, its
        settings and stream (seeded by sampling.seed), its stop tokens kept from being drawn before
        `min_tokens` new tokens, its recurrent state (hybrid) zeroed."""
        rows = torch.tensor([slot], device=self.device)
        for stage in self.stages:
            stage.table[slot].zero_()
            stage.table[slot, : len(blocks)] = torch.tensor(blocks, device=self.device)
            stage.cache.reset(rows)
        self.tokens[slot, : len(prompt)] = torch.tensor(prompt, device=self.device)
        self.lengths[slot] = len(prompt)
        self.host_lengths[slot] = len(prompt)
        settings = SamplingRows.of([sampling], self.device)
        for name in ("temperature", "top_p", "top_k"):
            getattr(self.sampling, name)[slot] = getattr(settings, name)[0]
        self.sampling.filters = self.sampling.filters or settings.filters
        min_length, row = stopping(stops, len(prompt) + min_tokens)
        self.sampling.min_length[slot] = min_length
        self.sampling.stops[slot] = torch.tensor(row, device=self.device)
        self.draws.seeds[slot], self.draws.counters[slot] = sampling.seed, 0
        if self.pending is not None:
            self.pending[slot] = 0

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[int, int, int]]) -> None:
        """Feed the prompt tokens [start, end) of each (slot, start, end) of `chunks` to the target,
        and those below the drafter's share (all but the last two) to the drafter, in one forward
        per stage, each chunk kept; a head gets the pairs of the target's features instead."""
        stages = [(self.verifier.stage, 1)]
        if self.drafter is not None and self.features is None:
            stages.append((self.drafter.stage, CATCH_UP))
        for stage, held_back in stages:  # (the prompt's last tokens, which the first step feeds)
            fed = [(slot, start, min(end, self.host_lengths[slot] - held_back)) for slot, start, end in chunks]
            fed = [chunk for chunk in fed if chunk[2] > chunk[1]]
            if not fed:
                continue
            tokens, layout = self._prompt_chunks(stage, fed)
            if self.features is None:
                stage.forward(tokens, layout)
            else:
                self._prompt_pairs(fed, layout, stage.forward_features(tokens, layout)[1])
            stage.cache.keep(layout.rows, layout.cu.diff())

    def _prompt_pairs(self, fed: list[tuple[int, int, int]], layout: Layout, features: torch.Tensor) -> None:
        """The head's pairs of the target's prompt chunks `fed` (features [T, C H], packed as `layout`
        says; head.py): all but each prompt's last pair, which its first catch-up feeds."""
        bounds = layout.cu.tolist()
        for i, (slot, start, _) in enumerate(fed):
            last = self.drafter.prompt_pairs(layout.rows[i : i + 1], self.tokens[slot], features[bounds[i] : bounds[i + 1]],
                                             start, self.host_lengths[slot])
            if last is not None:
                self.features[slot, 0] = last
                self.pending[slot] = 1

    def _prompt_chunks(self, stage: Stage, chunks: list[tuple[int, int, int]]) -> tuple[torch.Tensor, Layout]:
        """The committed tokens [start, stop) of each (slot, start, stop) of `chunks` packed for one
        forward of `stage`, each at its own slot and seeing those before it -> (packed tokens, layout)."""
        slots, starts, stops = (torch.tensor(column, device=self.device) for column in zip(*chunks))  # [R] each
        counts = stops - starts
        longest = max(stop - start for _, start, stop in chunks)
        offsets = torch.arange(longest, device=self.device)[None].expand(len(chunks), -1)  # [R, E]
        at = (starts[:, None] + offsets).clamp(max=self.tokens.shape[1] - 1)  # (past a row's count: padding)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
        return stage.pack(self.tokens[slots[:, None], at], starts[:, None] + offsets, slots, starts, offsets,
                          causal[None].expand(len(chunks), -1, -1), max(stop for *_, stop in chunks), counts,
                          sum(stop - start for _, start, stop in chunks))

    # -- decoding
    @torch.inference_mode()
    def decode(self, slots: list[int], budget: int | None = None) -> tuple[list[list[int]], Clock]:
        """One step of the requests in `slots` -> each one's new tokens (accepted drafts and the
        bonus, past its end as the step made them) and the step's clock (draft, verify marks).
        `budget`: draft nodes verified over the whole batch (a dynamic drafter), None: each its
        tree's. Where steps are captured, the batch is padded to a size of `sizes` with the padding
        row, and each phase replays the CUDA graph of its size (and budget)."""
        n = len(slots)
        size = next(b for b in self.sizes if b >= n) if self.captured else n
        rows = torch.tensor(slots + [self.padding] * (size - n), device=self.device)
        live = torch.arange(size, device=self.device) < n
        clock = Clock(self.device)
        result = self.step(rows, live, max(self.host_lengths[s] for s in slots), budget, clock)  # [R, D + 2]
        out = []
        for slot, (count, *new) in zip(slots, result[:n].tolist()):  # the step's one host read
            self.host_lengths[slot] += count
            out.append(new[:count])
        return out, clock

    def step(self, rows: torch.Tensor, live: torch.Tensor, longest: int, budget: int | None,
             clock: Clock | None = None) -> torch.Tensor:
        """The device work of a step of the requests in table rows `rows` [R] (`live` [R]: not
        padding; `longest`: the most committed tokens among them, which sizes eager forwards) ->
        [R, D + 2]: each one's count of new tokens, then the new tokens; no host read. `clock`:
        marked around the draft and the verify phases."""
        marks = clock.mark if clock is not None else lambda: None
        marks()
        size = rows.numel()
        drafted = () if self.drafter is None else self._replays.run(
            ("draft", size, budget), lambda rows, live: self._draft(rows, live, longest, budget).tensors(), rows, live)
        marks()
        result = self._replays.run(("verify", size, budget), lambda rows, *drafted: self._verify(
            rows, drafted, longest, budget), rows, *drafted)
        marks()
        return result

    def _requests(self, rows: torch.Tensor) -> tuple[Requests, SamplingRows, Draws]:
        """The step's requests (table rows `rows` [R]), their settings and random streams."""
        lengths = self.lengths[rows]
        if self.features is None:
            requests = Requests(rows, self.tokens, lengths, lengths.clamp(max=CATCH_UP), CATCH_UP)
        else:
            requests = Requests(rows, self.tokens, lengths, self.pending[rows], self.drafter.max_feeds, self.features[rows])
        return requests, self.sampling.take(rows), Draws(self.draws.seeds[rows], self.draws.counters[rows])

    def _draft(self, rows: torch.Tensor, live: torch.Tensor, longest: int, budget: int | None) -> Draft:
        requests, sampling, draws = self._requests(rows)
        width = self.drafter.stage.width(longest, self.drafter.span)
        draft = self.drafter.draft(requests, width, sampling, draws, budget, live)
        self.draws.counters.index_copy_(0, rows, draws.counters)
        return draft

    def _verify(self, rows: torch.Tensor, drafted: tuple[torch.Tensor, ...], longest: int,
                budget: int | None) -> torch.Tensor:
        requests, sampling, draws = self._requests(rows)
        draft = None
        if drafted:
            packed = None if budget is None else rows.numel() + min(budget, rows.numel() * self.drafter.nodes)
            draft = Draft.from_tensors(drafted, self.drafter.max_depth, packed)
        tree = self._roots(requests) if draft is None else draft.tree
        result = self._settle(tree, draft, requests, sampling, draws, longest)
        self.draws.counters.index_copy_(0, rows, draws.counters)
        self.lengths[self.padding].fill_(CATCH_UP)  # (the padding row's tokens stay where its next step needs them)
        return result

    def _settle(self, tree: Tree, draft: Draft | None, requests: Requests, sampling: SamplingRows, draws: Draws,
                longest: int) -> torch.Tensor:
        """The target's forward of the trees and what follows it: verdicts, both caches' commits and
        the append -> [R, D + 2]: each request's count of new tokens, then the new tokens (padded)."""
        verifier = self.verifier
        width = verifier.stage.width(longest, tree.size)
        if self.features is None:
            logits, layout = verifier.score(tree, requests.rows, requests.lengths, width)
        else:
            logits, features, layout = verifier.score_features(tree, requests.rows, requests.lengths, width)
        verdict = verifier.verdict(tree, logits, layout, sampling, draws if verifier.draws else None)
        counts, new = verdict.accepted(tree)
        if self.features is not None:  # the head's next pairs: the accepted path's features, with the new tokens
            nodes = layout.grid.gather(1, verdict.paths.clamp(min=0))  # [R, D + 1] packed row of each path node
            self.features.index_copy_(0, requests.rows, features[nodes])
            self.pending.index_copy_(0, requests.rows, counts)
        verifier.commit(verdict.paths, requests.rows, requests.lengths)
        if draft is not None:
            self.drafter.commit(draft, verdict.paths, requests)
        at = requests.lengths[:, None] + torch.arange(new.shape[1], device=self.device)  # [R, D + 1]
        self.tokens[requests.rows[:, None], at] = new  # (past the count: garbage the next step overwrites)
        self.lengths.index_copy_(0, requests.rows, requests.lengths + counts)
        return torch.cat([counts[:, None], new], 1)

    def _roots(self, requests: Requests) -> Tree:
        """An autoregressive step's trees: each request's last committed token alone."""
        r = requests.size
        return Tree(requests.last(1)[1], torch.full((r, 1), -1, dtype=torch.long, device=self.device), None,
                    self._root.expand(r))
