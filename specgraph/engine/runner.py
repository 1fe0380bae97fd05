"""The device side of an engine: every request slot's committed tokens, sampling settings and
random stream, the stages' block tables, and the batched work of a step.

A decoding step over R requests runs in one of the runner's modes (`Mode`): plain decoding (the
target alone, one token a request) or speculation with one of its drafters' trees. A speculative
step is two phases that read and write only device tensors:
  draft   - every request's catch-up and tree growth, one forward per tree level for all of them;
  verify  - the target scores the concatenation of all trees in one forward (ragged where a
            budget sizes them), the rule picks each request's path and bonus, both caches move the
            accepted K/V into place and the new tokens are appended.
A step is launched without a host read (`launch`); its result (each request's count of new tokens
and the tokens) comes back through pinned memory and an event, read when the engine collects it,
after it has launched the next step (`Launched.collect`). The device's committed lengths are the
truth: a step reads them, never the host's.

A request's slot stops at its end (`start`): a step finds the rows whose committed tokens reached
their end (a request that finished in the step before, still in this one's batch because the host
launched it before it read that) and runs them as the padding row, slot `slots` (one past the last
request slot): its table row points at the trash block, its committed length is put back after
every step, and whatever it computes stays there. Where steps are captured, a step of R requests
runs `step_rows(R)` rows, the next of CAPTURE_SIZES, the rows added being the padding row (under a
budget they verify no node), and each (mode, step rows, budget) has its own CUDA graph, recorded the
second time that shape runs: the end of a run, passing through batch sizes, meets a few shapes,
not one per size. Elsewhere a step has exactly the batch's rows.

A drafter is fed only while the engine speculates: a step without drafts leaves it behind, and
`sync_drafter` feeds it the committed tokens it missed (in prefill chunks) before it drafts again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraph.draft import Draft, Drafter, Requests
from specgraph.draws import Draws
from specgraph.head import HeadDrafter
from specgraph.layout import Layout
from specgraph.recipe import SamplingSpec
from specgraph.runtime.clock import Clock
from specgraph.runtime.graphs import Replays
from specgraph.runtime.stage import Stage
from specgraph.runtime.verifier import Verifier
from specgraph.sampling import STOP_IDS, SamplingRows, stopping
from specgraph.tree import CATCH_UP, Tree, TreeStructure


@dataclass(frozen=True)
class Mode:
    """What a step does: plain decoding (`drafter` None) or speculation with `drafter`'s trees."""

    name: str
    drafter: Drafter | None = None

    @property
    def depth(self) -> int:
        """The most drafts a request may accept in a step."""
        return 0 if self.drafter is None else self.drafter.max_depth

    @property
    def nodes(self) -> int:
        """Draft nodes a request's tree holds."""
        return 0 if self.drafter is None else self.drafter.nodes

    @property
    def shape(self) -> str:
        """Which acceptance rates price it: "plain", "chain" (one node a depth) or "tree" (more: it
        accepts more at each depth than a chain, so the two are counted apart)."""
        if self.drafter is None:
            return "plain"
        return "chain" if self.drafter.nodes == self.drafter.max_depth else "tree"


PLAIN = Mode("ar")
PREFILL_BUCKET = 16  # the fewest tokens a captured prompt forward is sized for
CAPTURE_AFTER = 2  # a step's (or prompt forward's) shape is captured the second time it runs: the first runs as it is
# a captured step's rows (past 64: multiples of 16): few shapes to capture as a run's end drains its batch, and a
# padding row costs little where they are close (a step of few rows is bound by reading the weights)
CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def prompt_bucket(chunks: int, tokens: int) -> tuple[int, int]:
    """(rows, tokens) of the captured prompt forward that replays `chunks` chunks of `tokens` tokens in
    all: each rounded up to a power of two, the tokens to PREFILL_BUCKET at least."""
    return 1 << (chunks - 1).bit_length(), max(PREFILL_BUCKET, 1 << (tokens - 1).bit_length())


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as a long tensor on `device`: on a GPU through pinned memory, copied without
    waiting (PyTorch's pinned-memory cache keeps the buffer until the copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


class Launched:
    """A step in flight: its result copied to pinned host memory behind an event."""

    def __init__(self, slots: list[int], mode: Mode, result: torch.Tensor, clock: Clock, steady: bool):
        self.slots, self.mode, self.clock = slots, mode, clock
        self.rows = result.shape[0]  # the step's rows: `slots`, then padding rows
        self.steady = steady  # whether its time is what a step of its shape costs (not a first run or a capture)
        if result.device.type == "cuda":
            self._host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            self._host.copy_(result, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = result.clone(), None

    def collect(self) -> tuple[list[tuple[int, list[int]]], tuple[float, ...]]:
        """Wait for the step -> (each request's count of new tokens and the new tokens, past its end
        as the step made them; none of padding rows), and its (draft, verify) seconds."""
        if self._done is not None:
            self._done.synchronize()
        rows = [(count, new[:count]) for count, *new in self._host[: len(self.slots)].tolist()]
        return rows, tuple(self.clock.seconds())


class Runner:
    def __init__(self, verifier: Verifier, drafter: Drafter | None, slots: int, capacity: int, compile: bool = False,
                 captured: bool = False, levels: tuple[Mode, ...] = ()):
        """`slots`: request slots (rows of the stages' tables, less the padding row); `capacity`:
        committed tokens a request may reach, and a step's worth past them; `compile`: run what
        follows the target's forward (verdicts, commits, append) through torch.compile under the
        greedy rule, a few fused kernels instead of some twenty (Inductor's code for the sampling
        rule's keyed noise crashed the process on the CPU and never finished on a GPU, run 113);
        `captured`: each step's phases replay CUDA graphs, one per (mode, batch size, budget);
        `levels`: speculation with smaller trees over `drafter`'s stage, the other speculative modes a
        policy may choose."""
        self.verifier, self.drafter = verifier, drafter
        self.device = verifier.device
        self.stages = [verifier.stage] + ([drafter.stage] if drafter is not None else [])
        self.modes = [PLAIN] + ([Mode(f"depth {drafter.max_depth}", drafter), *levels] if drafter else [])
        self.padding = slots
        rows = slots + 1
        self.tokens = torch.zeros(rows, capacity, dtype=torch.long, device=self.device)  # [rows, capacity]
        self.lengths = torch.full((rows,), CATCH_UP, dtype=torch.long, device=self.device)  # [rows]
        self.ends = torch.zeros(rows, dtype=torch.long, device=self.device)  # [rows] committed tokens a slot stops at
        self.stops = torch.full((rows, STOP_IDS), -1, dtype=torch.long, device=self.device)  # [rows, S] -1: none
        self.filtering = [False] * rows  # each slot's request filters by top-k or top-p
        self.forbidding = [False] * rows  # each slot's request keeps its stop tokens back for a while (min_tokens)
        self.host_lengths = [CATCH_UP] * rows  # as of the last step collected
        self.drafted = [0] * rows  # committed tokens the drafter's cache holds of each slot (exact once all is collected)
        self.sampling = SamplingRows.of([SamplingSpec()] * rows, self.device)
        self.draws = Draws(torch.zeros(rows, dtype=torch.long, device=self.device),
                           torch.zeros(rows, dtype=torch.long, device=self.device))
        self._root = TreeStructure.of([-1], self.device)
        self.features = self.pending = None  # a head's (head.py): the target's features of each row's pending pairs
        if isinstance(drafter, HeadDrafter):
            dtype = verifier.stage.model.embed_tokens.weight.dtype
            self.features = torch.zeros(rows, drafter.max_feeds, drafter.feature_width, dtype=dtype,
                                        device=self.device)  # [rows, max_feeds, C H]
            self.pending = torch.zeros(rows, dtype=torch.long, device=self.device)  # [rows] pairs not fed to the head
        self.unfed = [0] * rows  # the most pairs each slot's head may not have been fed, as of the last step launched
        self.captured = captured
        self.clock = Clock  # what times a step's phases (a test may charge its own)
        self._replays = Replays(captured, verifier.stage.pool, after=CAPTURE_AFTER)
        for stage in self.stages:
            stage.table[self.padding].zero_()
        if compile and verifier.spec.rule == "greedy":
            self._settle = torch.compile(self._settle, fullgraph=True)

    # -- a request's slot
    def start(self, slot: int, blocks: list[int], prompt: list[int], sampling: SamplingSpec, end: int,
              stops: tuple[int, ...] = (), min_tokens: int = 0) -> None:
        """A request takes `slot`: its blocks in every stage's table, its prompt committed, its
        settings and stream (seeded by sampling.seed), its stop tokens kept from being drawn before
        `min_tokens` new tokens, its recurrent state (hybrid) zeroed; no step decodes it once it has
        `end` committed tokens."""
        rows = to_device([slot], self.device)
        blocks = to_device(blocks, self.device)
        for stage in self.stages:
            stage.table[slot].zero_()
            stage.table[slot, : blocks.numel()] = blocks
            stage.cache.reset(rows)
        self.tokens[slot, : len(prompt)] = to_device(prompt, self.device)
        self.lengths[slot] = len(prompt)
        self.ends[slot] = end
        self.host_lengths[slot] = len(prompt)
        self.drafted[slot] = 0
        for name in ("temperature", "top_p", "top_k", "seed"):
            getattr(self.sampling, name)[slot] = getattr(sampling, name)
        self.filtering[slot] = sampling.top_k > 0 or sampling.top_p < 1
        min_length, row = stopping(stops, len(prompt) + min_tokens)
        self.sampling.min_length[slot] = min_length
        self.sampling.stops[slot] = to_device(row, self.device)
        self.forbidding[slot] = min_tokens > 0 and bool(stops)
        self.stops[slot] = to_device([*stops, *[-1] * (STOP_IDS - len(stops))], self.device)
        self.draws.seeds[slot], self.draws.counters[slot] = sampling.seed, 0
        if self.pending is not None:
            self.pending[slot] = 0
            self.unfed[slot] = 1  # (its prompt's last pair: prefill)

    @torch.inference_mode()
    def prefill(self, chunks: list[tuple[int, int, int]], drafter: bool = True) -> None:
        """Feed the prompt tokens [start, end) of each (slot, start, end) of `chunks` to the target,
        and (where `drafter`) those below the drafter's share (all but the last two) to the drafter,
        in one forward per stage, each chunk kept; a head gets the pairs of the target's features
        instead. A drafter not fed here is fed by `sync_drafter` before it drafts."""
        fed = self._within(chunks, 1)  # (the prompt's last token: the first step feeds it)
        if fed:
            self._forward_chunks(self.verifier.stage, fed)
        if drafter and self.drafter is not None and self.features is None:  # (a drafter left behind: sync_drafter)
            self._feed_drafter(self._within([c for c in chunks if self.drafted[c[0]] == c[1]], CATCH_UP))

    def lagging(self, slots: list[int]) -> list[int]:
        """The slots whose drafter misses committed tokens its catch-up does not feed (exact once
        every launched step is collected; a head, fed the target's features by every step, never does)."""
        return [s for s in slots if self.missed(s) > 0]

    def missed(self, slot: int) -> int:
        """Committed tokens of `slot` its drafter was not fed and its catch-up will not feed (as of
        the last step collected; 0 for a head or no drafter)."""
        if self.drafter is None or self.features is not None:
            return 0
        return max(self.host_lengths[slot] - CATCH_UP - self.drafted[slot], 0)

    @torch.inference_mode()
    def sync_drafter(self, slots: list[int], chunk: int) -> None:
        """Feed the drafter of each of `slots` the committed tokens it missed, all but the last
        two (its next catch-up feeds those), in forwards of at most `chunk` tokens; call once
        every launched step is collected."""
        share = min(chunk, self.drafter.stage.max_step_tokens)
        while slots := self.lagging(slots):
            chunks, left = [], chunk
            for slot in slots:
                if left == 0:
                    break
                start = self.drafted[slot]
                end = min(start + min(left, share), self.host_lengths[slot] - CATCH_UP)
                chunks.append((slot, start, end))
                left -= end - start
            self._feed_drafter(chunks)

    def _within(self, chunks: list[tuple[int, int, int]], held_back: int) -> list[tuple[int, int, int]]:
        """`chunks` cut to the committed tokens but each slot's last `held_back`; empty ones left out."""
        cut = [(slot, start, min(end, self.host_lengths[slot] - held_back)) for slot, start, end in chunks]
        return [chunk for chunk in cut if chunk[2] > chunk[1]]

    def _feed_drafter(self, chunks: list[tuple[int, int, int]]) -> None:
        if chunks:
            self._forward_chunks(self.drafter.stage, chunks)
        for slot, _, end in chunks:
            self.drafted[slot] = end

    def _forward_chunks(self, stage: Stage, chunks: list[tuple[int, int, int]]) -> None:
        """One forward of `stage` over the committed tokens [start, stop) of each (slot, start, stop)
        of `chunks`, each kept. Where steps are captured, it replays a CUDA graph of its bucket: the
        tokens rounded up to a power of two (16 at least), the chunks to a power of two of rows (those
        added: empty ones of the padding row), so that a prompt costs its forward, not its launches."""
        if not self.captured:
            self._chunks_forward(stage, *(to_device(list(c), self.device) for c in zip(*chunks)), *self._sizes(chunks))
            return
        rows, tokens = prompt_bucket(len(chunks), sum(stop - start for _, start, stop in chunks))
        longest = min(tokens, stage.max_step_tokens)  # (no chunk is longer: the engine's prefill share)
        padded = chunks + [(self.padding, 0, 0)] * (rows - len(chunks))
        inputs = tuple(to_device(list(column), self.device) for column in zip(*padded))
        self._replays.run(("prefill", stage.name, tokens, rows), lambda *inputs: self._chunks_forward(
            stage, *inputs, longest, stage.capacity, min(tokens, rows * longest)), *inputs)

    def _chunks_forward(self, stage: Stage, slots: torch.Tensor, starts: torch.Tensor, stops: torch.Tensor,
                        longest: int, width: int, total: int) -> None:
        """`stage`'s forward of the chunks (slots, starts, stops [R]: see `_prompt_chunks`), kept."""
        tokens, layout = self._prompt_chunks(stage, (slots, starts, stops), longest, width, total)
        if stage is self.verifier.stage and self.features is not None:  # (a head drafts from its features)
            self._prompt_pairs(slots, starts, stops, layout, stage.forward_features(tokens, layout, logits=False)[1],
                               width, total)
        else:
            stage.feed(tokens, layout)
        stage.cache.keep(layout.rows, layout.cu.diff())

    @staticmethod
    def _sizes(chunks: list[tuple[int, int, int]]) -> tuple[int, int, int]:
        """The longest chunk, the furthest slot and the tokens of `chunks`, (slot, start, stop) each."""
        return (max(stop - start for _, start, stop in chunks), max(stop for *_, stop in chunks),
                sum(stop - start for _, start, stop in chunks))

    def _prompt_pairs(self, slots: torch.Tensor, starts: torch.Tensor, stops: torch.Tensor, layout: Layout,
                      features: torch.Tensor, width: int, total: int) -> None:
        """The head's pairs of the target's prompt chunks (slots, starts, stops [R]; features [T, C H],
        packed as `layout` says; head.py), in one forward: all but each prompt's last pair (that of its
        token length - 2), which its first catch-up feeds (its features kept in the slot's first column)."""
        grid = features.index_select(0, layout.grid.clamp(min=0).flatten()).view(*layout.grid.shape, -1)  # [R, E, C H]
        root, holds = self.drafter.prompt_chunks(slots, self.tokens, grid, starts, stops, self.lengths[slots], width,
                                                 total)
        self.features[slots, 0] = torch.where(holds[:, None], root.to(self.features.dtype), self.features[slots, 0])
        self.pending[slots] = torch.where(holds, 1, self.pending[slots])

    def _prompt_chunks(self, stage: Stage, chunks, longest: int, width: int, total: int) -> tuple[torch.Tensor, Layout]:
        """The committed tokens [start, stop) of each (slot, start, stop) of `chunks` (host tuples, or
        slots, starts and stops [R] on the device) packed for one forward of `stage`, each at its own
        slot and seeing those before it, at most `longest` a chunk, `width` virtual slots and `total`
        tokens in all (past the chunks' own: padding) -> (packed tokens, layout)."""
        if not isinstance(chunks[0], torch.Tensor):
            chunks = tuple(to_device(list(column), self.device) for column in zip(*chunks))
        slots, starts, stops = chunks  # [R] each
        offsets = torch.arange(longest, device=self.device)[None].expand(slots.numel(), -1)  # [R, E]
        at = (starts[:, None] + offsets).clamp(max=self.tokens.shape[1] - 1)  # (past a row's count: padding)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=self.device).tril()
        return stage.pack(self.tokens[slots[:, None], at], starts[:, None] + offsets, slots, starts, offsets,
                          causal[None].expand(slots.numel(), -1, -1), width, stops - starts, total)

    # -- decoding
    def step_rows(self, requests: int) -> int:
        """The rows a step of `requests` requests runs: where steps are captured, the next capture
        size (the rest padding rows), so that few shapes are captured; elsewhere `requests`."""
        if not self.captured:
            return requests
        return next((size for size in CAPTURE_SIZES if size >= requests), -(-requests // 16) * 16)

    @torch.inference_mode()
    def launch(self, slots: list[int], mode: Mode, budget: int | None = None, in_flight: bool = False) -> Launched:
        """Enqueue one step of the requests in `slots` (padded to `step_rows`) in `mode` and return it
        in flight; no host read. `budget`: draft nodes verified over the whole step (a dynamic
        drafter), None: each row its tree's; `in_flight`: whether a step launched before is not
        collected yet (the host's lengths are then a step behind: the eager forwards' widths allow for it)."""
        step_tokens = max(m.depth for m in self.modes) + 1
        longest = max(self.host_lengths[s] for s in slots) + (step_tokens if in_flight else 0)
        clock = self.clock(self.device)
        rows = slots + [self.padding] * (self.step_rows(len(slots)) - len(slots))
        self.sampling.filters = any(self.filtering[s] for s in slots)  # (the work only this batch's requests need)
        self.sampling.forbids = any(self.forbidding[s] for s in slots)
        feed = self._feeds_head(slots, mode)
        steady = all(self._replays.ready((phase, *self._shape(mode, len(rows), budget)))
                     for phase in self._phases(mode, feed))
        result = self.step(to_device(rows, self.device), mode, longest, budget, clock, feed)
        return Launched(slots, mode, result, clock, steady)

    def _feeds_head(self, slots: list[int], mode: Mode) -> bool:
        """Whether a step in `mode` of `slots` feeds a head in a phase of its own: a plain step whose
        pair would not fit beside those its head was not fed yet (a speculative step's catch-up feeds
        them all). A plain step appends its pair, so the head is fed once every `max_feeds` plain
        steps, not at each (a plain step then costs it little); each slot's bound moves on."""
        if self.features is None:
            return False
        feed = mode.drafter is None and any(self.unfed[s] >= self.drafter.max_feeds for s in slots)
        for slot in slots:
            self.unfed[slot] = mode.depth + 1 if mode.drafter is not None else 1 if feed else self.unfed[slot] + 1
        return feed

    def collect(self, launched: Launched, keep: list[bool]) -> tuple[list[list[int]], tuple[float, ...]]:
        """Wait for a launched step -> the new tokens of each of its requests (past its end as the
        step made them) and its (draft, verify) seconds; its slots' host lengths (and what their
        drafters hold) move on where `keep` (not for a request that had finished before the step,
        whose slot may be another's now)."""
        rows, seconds = launched.collect()
        for slot, (count, _), kept in zip(launched.slots, rows, keep):
            if kept:
                self.host_lengths[slot] += count
                if launched.mode.drafter is not None:
                    self.drafted[slot] = self.host_lengths[slot] - CATCH_UP
        return [new for _, new in rows], seconds

    def step(self, rows: torch.Tensor, mode: Mode, longest: int, budget: int | None,
             clock: Clock | None = None, feed: bool = False) -> torch.Tensor:
        """The device work of a step of the requests in table rows `rows` [R] (`longest`: at least
        the most committed tokens among them, which sizes eager forwards) -> [R, D + 2]: each one's
        count of new tokens, then the new tokens; no host read. A row whose request reached its end
        runs as the padding row. `clock`: marked around the draft and the verify phases; `feed`: a
        plain step first feeds a head the pairs it was not fed (`_feeds_head`)."""
        marks = clock.mark if clock is not None else lambda: None
        marks()
        drafter = mode.drafter
        shape = self._shape(mode, rows.numel(), budget)
        drafted = ()
        if drafter is not None:
            drafted = self._replays.run(("draft", *shape), lambda rows: self._draft(
                drafter, self._alive(rows), longest, budget).tensors(), rows)
        elif feed:  # a head drafts nothing but takes the pairs the plain steps before left it
            self._replays.run(("feed", *shape), lambda rows: self._feed_head(self._alive(rows), longest), rows)
        marks()
        result = self._replays.run(("verify", *shape), lambda rows, *drafted: self._verify(
            drafter, self._alive(rows), drafted, longest, budget), rows, *drafted)
        marks()
        return result

    def _phases(self, mode: Mode, feed: bool) -> tuple[str, ...]:
        """The CUDA graphs a step in `mode` replays (`step`)."""
        if mode.drafter is not None:
            return "draft", "verify"
        return ("feed", "verify") if feed else ("verify",)

    def _shape(self, mode: Mode, rows: int, budget: int | None) -> tuple:
        """What a step's CUDA graphs are keyed on (what a graph holds of the sampling settings too)."""
        return mode.name, rows, budget, self.sampling.filters, self.sampling.forbids

    def _alive(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [R], each whose request reached its end replaced by the padding row."""
        return torch.where(self.lengths[rows] < self.ends[rows], rows, self.padding)

    def _requests(self, rows: torch.Tensor) -> tuple[Requests, SamplingRows]:
        """The step's requests (table rows `rows` [R]) and their settings (a head's: with their
        pending pairs, as many columns as the deepest of its trees feeds)."""
        lengths = self.lengths[rows]
        if self.features is None:
            requests = Requests(rows, self.tokens, lengths, lengths.clamp(max=CATCH_UP), CATCH_UP)
        else:
            requests = Requests(rows, self.tokens, lengths, self.pending[rows], self.drafter.max_feeds,
                                self.features[rows])
        return requests, self.sampling.take(rows)

    def _draft(self, drafter: Drafter, rows: torch.Tensor, longest: int, budget: int | None) -> Draft:
        requests, sampling = self._requests(rows)
        width = drafter.stage.width(longest, drafter.span)
        return drafter.draft(requests, width, sampling, budget, rows != self.padding)

    def _feed_head(self, rows: torch.Tensor, longest: int) -> None:
        """A plain step's head work: each request's pending pairs fed (rows [R]), none left pending."""
        head = self.drafter
        head.feed(self._requests(rows)[0], head.stage.width(longest, head.span))
        self.pending.index_fill_(0, rows, 0)

    def _verify(self, drafter: Drafter | None, rows: torch.Tensor, drafted: tuple[torch.Tensor, ...], longest: int,
                budget: int | None) -> torch.Tensor:
        requests, sampling = self._requests(rows)
        draws = Draws(self.draws.seeds[rows], self.draws.counters[rows])  # their streams (the typical rule's)
        draft = None
        if drafted:
            packed = None if budget is None else rows.numel() + min(budget, rows.numel() * drafter.nodes)
            draft = Draft.from_tensors(drafted, drafter.max_depth, packed)
        tree = self._roots(requests) if draft is None else draft.tree
        verifier = self.verifier
        width = verifier.stage.width(longest, tree.size)
        if self.features is None:
            (logits, layout), features = verifier.score(tree, requests.rows, requests.lengths, width), None
        else:
            logits, features, layout = verifier.score_features(tree, requests.rows, requests.lengths, width)
        result = self._settle(tree, logits, features, layout, drafter, draft, requests, sampling, draws)
        self.draws.counters.index_copy_(0, rows, draws.counters)
        self.lengths[self.padding].fill_(CATCH_UP)  # (the padding row's tokens stay where its next step needs them)
        return result

    def _settle(self, tree: Tree, logits: torch.Tensor, features: torch.Tensor | None, layout: Layout,
                drafter: Drafter | None, draft: Draft | None, requests: Requests, sampling: SamplingRows,
                draws: Draws) -> torch.Tensor:
        """What follows the target's forward of the trees (logits [T, V], a head's features [T, C H]
        or None): verdicts, both caches' commits and the append -> [R, D + 2]: each request's count
        of new tokens, then the new tokens (padded). (Compiled apart from the forward, whose layers
        are compiled each: a region around both would recompile the whole target per step shape.)"""
        verifier = self.verifier
        verdict = verifier.verdict(tree, logits, layout, sampling, draws if verifier.draws else None)
        counts, new = verdict.accepted(tree)
        if self.features is not None and draft is None:  # a plain step's pair, after those not fed yet
            at = self.pending[requests.rows].clamp(max=self.features.shape[1] - 1)  # [R] (launch keeps it in)
            self.features[requests.rows, at] = features[layout.grid[:, 0]]
            self.pending.index_copy_(0, requests.rows, at + counts)
        elif self.features is not None:  # the head's next pairs: the accepted path's features, with the new tokens
            nodes = layout.grid.gather(1, verdict.paths.clamp(min=0))  # [R, D + 1] packed row of each path node
            self.features[:, : nodes.shape[1]].index_copy_(0, requests.rows, features[nodes])
            self.pending.index_copy_(0, requests.rows, counts)
        verifier.commit(verdict.paths, requests.rows, requests.lengths)
        if draft is not None:
            drafter.commit(draft, verdict.paths, requests)
        at = requests.lengths[:, None] + torch.arange(new.shape[1], device=self.device)  # [R, D + 1]
        self.tokens[requests.rows[:, None], at] = new  # (past the count: garbage the next step overwrites)
        self.lengths.index_copy_(0, requests.rows, requests.lengths + counts)
        kept = torch.arange(new.shape[1], device=self.device) < counts[:, None]  # [R, D + 1]
        stopped = ((new[..., None] == self.stops[requests.rows][:, None]).any(-1) & kept).any(1)  # [R] drew a stop
        self.ends.index_copy_(0, requests.rows, torch.where(stopped, requests.lengths + counts, self.ends[requests.rows]))
        return torch.cat([counts[:, None], new], 1)

    def _roots(self, requests: Requests) -> Tree:
        """An autoregressive step's trees: each request's last committed token alone."""
        r = requests.size
        return Tree(requests.last(1)[1], torch.full((r, 1), -1, dtype=torch.long, device=self.device),
                    self._root.expand(r))
