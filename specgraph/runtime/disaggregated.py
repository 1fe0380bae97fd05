"""Disaggregated asynchronous tree speculation (SwiftSpec): the drafter and the target run in
processes of their own, on their own devices, each with its own tensor-parallel degree, and talk
only through typed messages (runtime/channel.py): trees up, verdicts down.

    target  recv tree t  | verify t | send verdict t | read | recv tree t + 1 | verify ...
    drafter send tree t  | grow G steps (while t is verified) | recv verdict t | re-root | send t + 1 ...

A chain or dynamic drafter keeps one growing tree (growing.py): it sends the N most likely nodes,
grows G more expansion steps while the target verifies them, and re-roots at the verdict — at
once when the bonus token is already one of its nodes, which is what keeps the draft off the
critical path. A static tree is drafted anew after each verdict (the serial drafter's growth).

An EAGLE-3 head (head.py) drafts static trees from the target's features: the target sends the
prompt's features after its prefill (FEATURE_CHUNK rows a message) and, with each verdict, those
of the accepted path, which the head's next catch-up feeds. Features travel as fp32 (exact for
bf16 and fp16 models, whatever the two stages' dtypes).

Each rank of a stage runs the same steps on its shard and receives the same messages (its
leader broadcasts them), so every rank takes the same decisions. Each side reads the host once
per step. On a GPU each side's phases are captured as CUDA graphs where they draw nothing; the
messages go between the graphs.
"""

from __future__ import annotations

import time

import torch

from specgraph.draft import Draft, Drafter, Requests
from specgraph.draws import Draws
from specgraph.growing import GrowingDrafter
from specgraph.head import HeadDrafter
from specgraph.runtime.channel import Link, ProtocolError, TreeMessage, VerdictMessage
from specgraph.runtime.clock import Clock
from specgraph.runtime.executor import Generation, Output
from specgraph.runtime.graphs import Replays
from specgraph.runtime.sequence import Sequence
from specgraph.runtime.verifier import Verifier
from specgraph.sampling import SamplingRows
from specgraph.watchdog import PROGRESS
from specgraph.tree import CATCH_UP, Tree, TreeStructure


FEATURE_CHUNK = 64  # rows of prompt features a message carries


def _read(result: torch.Tensor) -> list[int]:
    """The step's one host read."""
    return result.tolist()


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """rows [n, ...] with zero rows after them up to `count`."""
    return torch.cat([rows, rows.new_zeros(count - rows.shape[0], *rows.shape[1:])])


class VerifySide:
    """The target's part: verify each tree the drafter sends, send back the verdict."""

    def __init__(self, verifier: Verifier, trees: Link, verdicts: Link, drafter_name: str, nodes: int, depth: int,
                 eos_ids: tuple[int, ...], max_seq_len: int, step_graphs: bool, sampling: SamplingRows):
        """`nodes`, `depth`: the trees' N and depth bound."""
        self.verifier, self.trees, self.verdicts, self.sampling = verifier, trees, verdicts, sampling
        self.device = verifier.device
        self.nodes, self.depth = nodes, depth
        self.max_seq_len = max_seq_len
        self.sequence = Sequence(max_seq_len + nodes + 1, self.device)
        self.eos_ids = tuple(eos_ids)
        self.eos = torch.tensor(eos_ids or [-1], device=self.device)
        self.tree_buffer = torch.zeros(2 * nodes + 3, dtype=torch.long, device=self.device)
        self.emitted = torch.zeros((), dtype=torch.long, device=self.device)
        self.budget = torch.zeros((), dtype=torch.long, device=self.device)
        self.phases = Replays(step_graphs, verifier.stage.pool)
        self.waiting = f"waiting for a tree from stage {drafter_name} (rank {trees.src_rank})"
        self.features = bool(verifier.stage.capture)  # an EAGLE-3 head drafts: features go with the verdicts

    def _verify(self, packed: torch.Tensor, sampling: SamplingRows, draws: Draws | None,
                width: int) -> tuple[torch.Tensor, ...]:
        """One tree (packed as its message) -> (the verdict's messages: its own packed, and the accepted
        path's features where a head drafts; [ok, stop, count, *new])."""
        message = TreeMessage.unpack(packed)
        seq = self.sequence
        structure = TreeStructure.of_parents(message.parents[None], self.depth, self.nodes)
        tree = Tree(message.tokens[None], message.parents[None], structure)
        ok = message.continues(seq.length)
        row = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.features:
            logits, features, layout = self.verifier.score_features(tree, row, seq.length.reshape(1), width)
        else:
            logits, layout = self.verifier.score(tree, row, seq.length.reshape(1), width)
        verdict = self.verifier.verdict(tree, logits, layout, sampling, draws)
        counts, news = verdict.accepted(tree)
        count, new, path = counts[0], news[0], verdict.paths[0]
        base = seq.length.clone()
        self.verifier.commit(verdict.paths, row, base.reshape(1))
        seq.append(new, count)
        self.emitted += count
        ends = (new[None, :] == self.eos[:, None]).any(0) & (torch.arange(new.numel(), device=self.device) < count)
        stop = (self.emitted >= self.budget) | ends.any()
        reply = (VerdictMessage(base, count, stop, path, new).pack(),)
        if self.features:  # the accepted path's [D + 1, C H] (past the count: padding)
            reply += (features[layout.grid[0].gather(0, path.clamp(min=0))].float(),)
        return reply, torch.cat([torch.stack([ok.long(), stop.long(), count]), new])

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        start = time.perf_counter()
        draws = Draws.of([seed], self.device) if self.verifier.draws else None
        self.sampling.seed.fill_(seed)  # (the sampling rule's key)
        prompt = torch.tensor(prompt_ids, device=self.device)
        self.sequence.start(prompt)
        features = self.verifier.prefill(prompt)
        if features is not None:
            for start in range(0, features.shape[0], FEATURE_CHUNK):
                self.verdicts.send(_padded(features[start : start + FEATURE_CHUNK], FEATURE_CHUNK).float())
        length = len(prompt_ids)
        out = Generation(output_ids=[])
        output = Output(out, length, max_new_tokens, self.max_seq_len, self.eos_ids)
        self.budget.fill_(output.budget)
        self.emitted.zero_()
        verify_s = wait_s = 0.0
        while True:  # until a verdict says stop: the drafter stops on the same message
            clock = Clock(self.device)
            clock.mark()
            PROGRESS.enter(self.waiting)
            self.trees.recv(self.tree_buffer)
            clock.mark()
            width = self.verifier.stage.width(length, self.nodes + 1)
            reply, result = self.phases.run("verify", lambda t: self._verify(t, self.sampling, draws, width),
                                            self.tree_buffer)
            clock.mark()
            self.verdicts.send(*reply)
            ok, stop, count, *new = _read(result)
            waited, verified = clock.seconds()
            wait_s, verify_s = wait_s + waited, verify_s + verified
            if not ok:
                raise ProtocolError("a tree did not continue from the target's committed tokens")
            out.target_steps += 1
            length += count
            output.take(new[:count])
            if out.target_steps == 1:
                out.first_token_seconds = time.perf_counter() - start
            if stop:
                break
        out.seconds = time.perf_counter() - start
        out.verify_seconds = verify_s
        if self.trees.ranks.rank == self.trees.dst_rank:
            out.stats = {"target_verify_seconds": verify_s, "target_wait_seconds": wait_s}
        return out


class DraftSide:
    """The drafter's part: send a tree, grow while it is verified, re-root at its verdict."""

    def __init__(self, drafter: GrowingDrafter | Drafter, trees: Link, verdicts: Link, target_name: str,
                 max_seq_len: int, step_graphs: bool, sampling: SamplingRows):
        """`sampling`: the recipe's settings, with which a static drafter draws."""
        self.drafter, self.trees, self.verdicts, self.sampling = drafter, trees, verdicts, sampling
        self.stage = drafter.stage
        self.device = self.stage.device
        growing = isinstance(drafter, GrowingDrafter)
        self.nodes = drafter.growth.nodes if growing else drafter.nodes
        self.depth = drafter.growth.depth if growing else drafter.max_depth
        self.sequence = Sequence(max_seq_len + self.nodes + 1, self.device)
        self.region = self.stage.capacity - max_seq_len  # slots a step may write past the committed prefix
        self.verdict_buffer = torch.zeros(2 * self.depth + 5, dtype=torch.long, device=self.device)
        self.phases = Replays(step_graphs, self.stage.pool)
        self.waiting = f"waiting for a verdict from stage {target_name} (rank {verdicts.src_rank})"
        self._draft: Draft | None = None  # the static drafter's last tree and request, for its commit
        self._request: Requests | None = None
        self.head = isinstance(drafter, HeadDrafter)
        if self.head:  # the target's features of the tokens the next catch-up feeds, and their count
            self.features = torch.zeros(1, drafter.max_feeds, drafter.feature_width, device=self.device,
                                        dtype=self.stage.model.fc.weight.dtype)
            self.pending = torch.zeros(1, dtype=torch.long, device=self.device)
            self.feature_buffer = torch.zeros(drafter.max_feeds, drafter.feature_width, device=self.device)
            self.prompt_buffer = torch.zeros(FEATURE_CHUNK, drafter.feature_width, device=self.device)

    def _width(self, length: int) -> int:
        """Slots the drafter's forwards attend over, `length` tokens committed."""
        return self.stage.width(length, self.region)

    # -- a growing tree: phases
    def _restart(self, length: int, feeds: int) -> torch.Tensor:
        seq = self.sequence
        self.drafter.restart(seq.tokens, seq.length, self._width(length), feeds)
        return self._select()

    def _select(self) -> torch.Tensor:
        tokens, parents = self.drafter.select()
        return TreeMessage(self.sequence.length, tokens, parents).pack()

    def _grow(self, length: int) -> None:
        self.drafter.expand(self.sequence.length, self._width(length))

    def _settle(self, packed: torch.Tensor) -> torch.Tensor:
        """A verdict -> [ok, stop, count, survived, bonus was a node]: the tree re-rooted, the new tokens committed."""
        verdict = VerdictMessage.unpack(packed)
        seq = self.sequence
        ok = verdict.continues(seq.length)
        survived, present = self.drafter.reroot(verdict.path, verdict.count, verdict.new, seq.length)
        seq.append(verdict.new, verdict.count)
        return torch.stack([ok.long(), verdict.stop.long(), verdict.count, survived.long(), present.long()])

    # -- a static tree: drafted anew after each verdict
    def _static_draft(self, length: int, feeds: int) -> torch.Tensor:
        seq = self.sequence
        if self.head:
            self._request = Requests(torch.zeros(1, dtype=torch.long, device=self.device), seq.tokens[None],
                                     seq.length.reshape(1), self.pending, self.drafter.max_feeds, self.features)
        else:
            self._request = Requests.one(seq.tokens, seq.length, feeds)
        self._draft = self.drafter.draft(self._request, self._width(length), self.sampling)
        tree = self._draft.tree
        return TreeMessage(seq.length, tree.tokens[0], tree.parents[0]).pack()

    def _static_settle(self, packed: torch.Tensor) -> torch.Tensor:
        verdict = VerdictMessage.unpack(packed)
        seq = self.sequence
        ok = verdict.continues(seq.length)
        self.drafter.commit(self._draft, verdict.path[None], self._request)
        seq.append(verdict.new, verdict.count)
        if self.head:  # the next catch-up's pairs: the accepted path's features, with the new tokens
            self.features[0] = self.feature_buffer
            self.pending.copy_(verdict.count.reshape(1))
        none = torch.zeros_like(verdict.count)
        return torch.stack([ok.long(), verdict.stop.long(), verdict.count, none, none])

    def _prefill_head(self, prompt: torch.Tensor) -> None:
        """The head's pairs of the prompt, from the features the target sends after its prefill."""
        self.stage.reset()
        self.pending.zero_()
        length, row = prompt.numel(), torch.zeros(1, dtype=torch.long, device=self.device)
        for start in range(0, length - 1, FEATURE_CHUNK):
            chunk = self.verdicts.recv(self.prompt_buffer)[0][: min(FEATURE_CHUNK, length - 1 - start)]
            bounds = torch.tensor([start, start + chunk.shape[0], length], device=self.device)[:, None]  # [3, 1]
            root, holds = self.drafter.prompt_chunks(row, self.sequence.tokens[None], chunk[None].to(self.features.dtype),
                                                     *bounds, start + chunk.shape[0], chunk.shape[0])
            self.features[0, 0] = torch.where(holds[0], root[0], self.features[0, 0])
            self.pending.copy_(torch.where(holds, 1, self.pending))

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        growing = isinstance(self.drafter, GrowingDrafter)
        self.sampling.seed.fill_(seed)  # (the sampling rule's key: the target's)
        prompt = torch.tensor(prompt_ids, device=self.device)
        self.sequence.start(prompt)
        if self.head:
            self._prefill_head(prompt)
        elif not growing:
            self.drafter.prefill(prompt)
        else:  # all but the last two tokens: the first catch-up feeds those
            self.stage.reset()
            if prompt.numel() > CATCH_UP:
                self.stage.prefill(prompt[:-CATCH_UP])
        length = len(prompt_ids)
        feeds = min(CATCH_UP, length)
        rounds = survived = ungrown = 0
        clock = Clock(self.device)
        clock.mark()
        tree = (self.phases.run(f"restart{feeds}", lambda: self._restart(length, feeds)) if growing
                else self._static_draft(length, feeds))
        while True:
            PROGRESS.enter("drafting")
            self.trees.send(tree)
            clock.mark()  # the tree is out
            if growing:  # while the target verifies it
                for _ in range(self.drafter.growth.grow):
                    self.phases.run("grow", lambda: self._grow(length))
            clock.mark()
            PROGRESS.enter(self.waiting)
            self.verdicts.recv(self.verdict_buffer, *((self.feature_buffer,) if self.head else ()))
            clock.mark()  # the verdict is in
            settle = self._settle if growing else self._static_settle
            ok, stop, count, kept, present = _read(self.phases.run("settle", settle, self.verdict_buffer))
            if not ok:
                raise ProtocolError("a verdict did not answer the drafter's last tree")
            rounds += 1
            ungrown += present and not kept
            length += count
            if stop:
                clock.mark()
                break
            PROGRESS.enter("drafting")
            if not growing:
                tree = self._static_draft(length, CATCH_UP)
            elif kept:
                survived += 1
                tree = self.phases.run("select", self._select)
            else:
                tree = self.phases.run(f"restart{CATCH_UP}", lambda: self._restart(length, CATCH_UP))
        marks = clock.seconds()  # first tree, then per round: grow, idle, settle + next tree
        first, rest = marks[0], marks[1:]
        hidden = sum(rest[0::3])
        idle = sum(rest[1::3])
        critical = first + sum(rest[2::3])
        out = Generation(output_ids=[], draft_seconds=hidden + critical)
        if self.trees.ranks.rank == self.trees.src_rank:
            out.stats = {"draft_hidden_seconds": hidden, "draft_critical_seconds": critical,
                         "draft_idle_seconds": idle, "rounds": rounds, "survived": survived,
                         "bonus_not_grown": ungrown}
        return out
