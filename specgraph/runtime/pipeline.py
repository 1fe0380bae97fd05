"""Hierarchical pipelines (PipeSpec): k stages in processes of their own, all running at once.

Stage 0 drafts chains into its committed tokens (or trees: below); stage i > 0 takes the tokens
stage i - 1 sent it, verifies up to a window of them in one forward (a chain rooted at its last
committed token), commits the accepted ones and its own next token (the bonus: a correction
where it rejected), and passes what it committed on to stage i + 1; the last stage's committed
tokens are the output.
Every stage is exact in its own right: it commits only what its rule accepts, so the output is the
last stage's own greedy output (for the sampling rule, its own sample with the request's seed: every
stage keys its noise by the seed, so each token is the stage's perturbed argmax there, whatever was
sent up).

Messages (runtime/channel.py's Mailbox; each carries a header [kind, epoch, position, count] and a
payload of `count` longs):
    TOKENS    up    committed tokens from `position` on, tagged with the epoch of the last CHECK
                    the sender applied;
    TREE      up    (a first stage that drafts trees) a tree rooted at its last committed token,
                    `position` its committed length: its tokens, then its parents;
    PROGRESS  down  the sender has committed `position` tokens, consistent with the receiver's;
    CHECK     down  the sender's tokens just before `position` are the payload (one token, or a
                    verified tree's path to a first stage that drafts trees): the receiver adopts
                    them (rolling back whatever it has from there on, or extending its tokens by
                    them) and sends again from `position`. It opens a new epoch: TOKENS of an older
                    one are kept only where no later CHECK contradicts them, TREEs never;
    STOP      down  the last stage is done; DONE up: the sender has sent its last message.
A stage sends CHECK where its new token contradicts, or may contradict, the tokens below it (a
rejection, or a bonus past what it has received), PROGRESS otherwise. A stage that changed its
tokens on a CHECK checks the stage below in turn: a mismatch at stage i rolls back every stage
below it, each as soon as it reads its inbox (between two forwards), not after a round trip.

Rollback keeps every committed token's K/V: the stage's tokens are cut back and the cache keeps
the slots of the tokens before the cut (`fed`: the committed tokens whose K/V the cache holds).
Tokens adopted from above whose K/V are not in the cache yet (extensions: at most one from each
stage above, before the stage steps again) are fed with the next window, as nodes whose own
checks are forced (their parents' logits say them for certain).

A first stage that drafts trees (static or dynamic) sends one and waits for the CHECK that answers
it (it cannot know which branch to go on from); the stages above it run as with chains.

Asynchronous: a stage steps whenever it has tokens to verify (stage 0: always) and no more than
`ahead` tokens of its own are unverified above, and sends what it committed after every step.
Synchronous (the ablation): a stage sends only once it has a whole window for the stage above
(`ahead` = that window) and then waits for its answer before it goes on, so the stages take turns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specgraph.draft import Drafter, Requests
from specgraph.draws import Draws
from specgraph.runtime.channel import Mail, Mailbox, ProtocolError
from specgraph.runtime.executor import Generation, Output
from specgraph.runtime.sequence import Sequence
from specgraph.runtime.verifier import Verifier
from specgraph.sampling import SamplingRows
from specgraph.watchdog import PROGRESS as WATCHDOG
from specgraph.tree import CATCH_UP, Tree, TreeStructure

TOKENS, TREE, PROGRESS, CHECK, STOP, DONE = range(6)


def stream(seed: int, index: int, device: torch.device) -> Draws:
    """Stage `index`'s random numbers for a request of `seed`: a stream of its own (two stages
    drawing the same uniforms would accept together, which biases what the stage above sees)."""
    return Draws.of([seed * 1009 + index], device)


@dataclass
class StageCounts:
    """What one stage did for one request (its `stats` in the Generation, keyed `<stage>.<name>`)."""

    index: int = 0  # the stage's place, the first stage 0
    requests: int = 1  # (summed over requests, the constants above and below divide by this)
    steps: int = 0
    step_seconds: float = 0.0  # in its steps, each ending at its host read
    idle_seconds: float = 0.0  # waiting for a message, with nothing to do
    proposed: int = 0  # tokens sent to the stage above
    verified: int = 0  # tokens of the stage below in its windows (those past a rejection were not tried)
    accepted: int = 0  # of those, accepted
    rejections: int = 0  # steps that rejected a token
    rolled_back: int = 0  # committed tokens cut by a CHECK from above
    dropped: int = 0  # received tokens dropped unverified: stale (sent before a CHECK arrived) or contradicted
    window: int = 0

    def stats(self, name: str) -> dict[str, float]:
        return {f"{name}.{key}": float(value) for key, value in vars(self).items()}


class Followers:
    """A tensor-parallel stage's ranks as one: the leader broadcasts each of its decisions (a
    message to handle, or None: a step) over the stage's group, and the other ranks take them in
    the same order, so every rank runs the same steps on its shard (their collectives meet)."""

    def __init__(self, group, leader: int, device: torch.device, capacity: int):
        self.group, self.leader, self.capacity = group, leader, capacity
        self.device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def share(self, mail: Mail | None) -> None:
        """The leader: tell the others."""
        packed = torch.zeros(2 + Mailbox.HEADER + self.capacity, dtype=torch.long)
        if mail is not None:
            packed[: 2 + Mailbox.HEADER + len(mail.payload)] = torch.tensor([1, mail.src, *mail.header, *mail.payload])
        dist.broadcast(packed.to(self.device), self.leader, group=self.group)

    def receive(self) -> Mail | None:
        """The other ranks: the leader's next decision."""
        packed = torch.zeros(2 + Mailbox.HEADER + self.capacity, dtype=torch.long, device=self.device)
        dist.broadcast(packed, self.leader, group=self.group)
        is_mail, src, *rest = packed.tolist()
        if not is_mail:
            return None
        header = rest[: Mailbox.HEADER]
        return Mail(src, header, rest[Mailbox.HEADER : Mailbox.HEADER + header[3]])


class PipelinePeer:
    """One stage's part: its committed tokens (host list: the decisions are the host's), what it
    has received and not yet verified, and its exchanges with the stages below and above."""

    def __init__(self, names: list[str], index: int, leaders: list[int], mailbox: Mailbox | None, window: int,
                 ahead: int, synchronous: bool, device: torch.device, max_seq_len: int, eos_ids: tuple[int, ...],
                 sampling: SamplingRows, followers: Followers | None = None):
        """`names`, `leaders`: every stage's name and rank, first stage first; `mailbox`: the
        leader's (None on the other ranks of a tensor-parallel stage, which follow its decisions
        through `followers`); `window`: tokens verified per step (stage > 0); `ahead`: own tokens
        that may be unverified above (stage < last); `eos_ids`: where the last stage's output ends;
        `sampling`: the request's settings (the recipe's)."""
        self.name, self.index, self.mailbox, self.followers = names[index], index, mailbox, followers
        self.below = leaders[index - 1] if index > 0 else None
        self.above = leaders[index + 1] if index + 1 < len(leaders) else None
        self.called = {leaders[i]: f"stage {names[i]} (rank {leaders[i]})" for i in (index - 1, index + 1)
                       if 0 <= i < len(names)}  # the stages beside this one
        self.waiting = "waiting for a message from " + " or ".join(self.called.values())
        if mailbox is None:
            self.waiting = f"waiting for the decisions of its leader (rank {leaders[index]})"
        self.window, self.ahead, self.synchronous = window, ahead, synchronous
        self.device, self.max_seq_len, self.eos_ids, self.sampling = device, max_seq_len, tuple(eos_ids), sampling

    # -- per request state
    def start(self, prompt_ids: list[int]) -> None:
        self.committed = list(prompt_ids)
        self.fed = 0  # committed tokens whose K/V the cache holds
        self.pending: list[int] = []  # received, unverified: positions pending_at ...
        self.pending_at = len(prompt_ids)  # len(committed), or one less right after a step or a CHECK
        self.sent = len(prompt_ids)  # committed tokens the stage above has (or will get)
        self.verified_above = len(prompt_ids)  # committed tokens the stage above has verified
        self.epoch_below = 0  # CHECKs sent down
        self.checks: dict[int, tuple[int, list[int]]] = {}  # epoch -> the CHECK (position, tokens) that opened it
        self.epoch_seen = 0  # the last CHECK applied
        self.below_length = len(prompt_ids)  # a tree-drafting first stage below: its committed tokens (ours up to there)
        self.stopping = False
        self.done_below = self.below is None
        self.counts = StageCounts(index=self.index, window=self.window)
        if self.mailbox is not None:
            self.mailbox.open(int(self.above is not None) + int(self.below is not None),
                              lambda header: header[0] in (STOP, DONE))

    # -- the loop
    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, seed: int = 0) -> Generation:
        """This stage's part of one request; the last stage's Generation holds the output."""
        began = time.perf_counter()
        out = Generation(output_ids=[])
        self.output = Output(out, len(prompt_ids), max_new_tokens, self.max_seq_len, self.eos_ids)  # (the last stage's)
        self.start(prompt_ids)
        self.begin(prompt_ids, seed)
        first_token_seconds = None
        if self.above is None and self.output.room <= 0:
            self.stop()
        while not (self.stopping and self.done_below):
            if self.followers is None:
                mail = self.decide()
            elif self.mailbox is not None:
                mail = self.decide()
                self.followers.share(mail)
            else:
                WATCHDOG.enter(self.waiting)
                mail = self.followers.receive()
            if mail is None:
                self.timed_step()
                if first_token_seconds is None:
                    first_token_seconds = time.perf_counter() - began
                if not self.synchronous or self.unverified_above() >= self.ahead:
                    self.flush()
                continue
            WATCHDOG.enter("handling a message")
            self.handle(mail)
        if self.above is not None:
            self.send(self.above, [DONE, 0, 0, 0])
        if self.mailbox is not None:
            self.mailbox.close()
        stats = self.counts.stats(self.name) if self.mailbox is not None else {}  # the leader's speak for the stage
        out.stats, out.seconds = stats, time.perf_counter() - began
        if self.above is None:
            out.target_steps, out.verify_seconds = self.counts.steps, self.counts.step_seconds
            out.first_token_seconds = first_token_seconds or out.seconds
        return out

    def decide(self) -> Mail | None:
        """The leader: the next message to handle, or None to step (waiting when there is neither)."""
        mail = self.mailbox.get(block=False)
        if mail is not None or (not self.stopping and self.can_step()):
            return mail
        if not self.stopping and (not self.synchronous or self.unverified_above() >= self.ahead):
            self.flush()
        WATCHDOG.enter(self.waiting)
        waited = time.perf_counter()
        mail = self.mailbox.get(block=True)
        self.counts.idle_seconds += time.perf_counter() - waited
        return mail

    def send(self, dst: int, header: list[int], tokens: list[int] = ()) -> None:
        """The leader sends (the other ranks of a tensor-parallel stage take the same decisions, silently)."""
        if self.mailbox is None:
            return
        with WATCHDOG.within(f"sending to {self.called[dst]}"):  # (a send blocks while its receiver cannot take it)
            self.mailbox.send(dst, header, tokens)

    def stop(self) -> None:
        """Decoding ends (the last stage decides; each stage below hears it from the one above)."""
        self.stopping = True
        if self.below is not None:
            self.send(self.below, [STOP, 0, 0, 0])

    def timed_step(self) -> None:
        WATCHDOG.enter("a step")
        began = time.perf_counter()
        self.step()
        self.counts.steps += 1
        self.counts.step_seconds += time.perf_counter() - began

    def unverified_above(self) -> int:
        return len(self.committed) - self.verified_above

    def handle(self, mail: Mail) -> None:
        kind, epoch, position, _ = mail.header
        if kind == TOKENS:
            assert mail.src == self.below
            self.receive(epoch, position, mail.payload)
        elif kind == TREE:
            assert mail.src == self.below
            self.receive_tree(epoch, position, mail.payload)
        elif kind == DONE:
            self.done_below = True
        elif kind == STOP:
            self.stop()
        elif kind == PROGRESS:
            self.verified_above = position
        elif kind == CHECK:
            self.epoch_seen = epoch
            self.verified_above = position
            self.adopt(position, mail.payload)
        else:
            raise ProtocolError(f"stage {self.name}: unknown message kind {kind}")

    def receive(self, epoch: int, position: int, tokens: list[int]) -> None:
        """TOKENS from below: keep what continues what this stage has (verified and pending)."""
        if self.stopping or not self.survives(epoch, position, tokens):
            self.counts.dropped += len(tokens)
            return
        have = self.pending_at + len(self.pending)
        if position > have:
            raise ProtocolError(f"stage {self.name}: tokens from position {position}, but it has only {have}")
        skip = have - position  # already here (sent again after a CHECK that changed nothing below)
        self.pending += tokens[skip:]

    def receive_tree(self, epoch: int, position: int, payload: list[int]) -> None:
        """A TREE from below (rooted at our token position - 1); stale if a CHECK went out since."""
        raise ProtocolError(f"stage {self.name}: a tree from below, which drafts chains")

    def survives(self, epoch: int, position: int, tokens: list[int]) -> bool:
        """Whether TOKENS sent before the stage below applied our CHECKs of later epochs still hold:
        a CHECK (m, c) changes nothing below where its tokens before m already were c, and nothing
        before them, so tokens that stop short of c's positions, or hold c there, are what it still has."""
        for later in range(epoch + 1, self.epoch_below + 1):
            m, checked = self.checks[later]
            start = m - len(checked)
            if position + len(tokens) > start:  # the tokens reach the checked positions
                if position > start or tokens[start - position : m - position] != checked[: m - position]:
                    return False
        return True

    def adopt(self, position: int, tokens: list[int]) -> None:
        """A CHECK: the stage above committed `tokens` just before `position`, after our tokens before them."""
        length, start = len(self.committed), position - len(tokens)
        if start > length:
            raise ProtocolError(f"stage {self.name}: a CHECK from {start}, past its {length} tokens")
        self.sent = position  # the stage above has everything before; it takes the rest again
        if self.committed[start:position] == tokens:
            return
        self.counts.rolled_back += length - start
        del self.committed[start:]
        self.committed += tokens
        self.fed = min(self.fed, start)
        self.below_length = min(self.below_length, start)
        self.on_adopt(start)
        if self.below is not None:
            self.reconcile()

    def reconcile(self) -> None:
        """After this stage's last token changed or was added: keep the pending tokens that agree
        with it and tell the stage below (PROGRESS), or drop them and check it (CHECK)."""
        length, last = len(self.committed), self.committed[-1]
        if self.pending and self.pending_at == length - 1 and self.pending[0] == last:
            self.pending = self.pending[1:]
            self.pending_at = length
            self.send(self.below, [PROGRESS, 0, length, 0])
            return
        self.counts.dropped += len(self.pending)
        self.pending, self.pending_at = [], length
        self.check_below([last])

    def check_below(self, tokens: list[int]) -> None:
        """CHECK the stage below with our last `tokens` (a new epoch)."""
        length = len(self.committed)
        self.epoch_below += 1
        self.checks[self.epoch_below] = (length, tokens)
        self.send(self.below, [CHECK, self.epoch_below, length, len(tokens)], tokens)

    def flush(self) -> None:
        """The leader: send the stage above what it does not have yet."""
        while self.mailbox is not None and self.above is not None and self.sent < len(self.committed):
            tokens = self.committed[self.sent : self.sent + self.mailbox.capacity]
            self.send(self.above, [TOKENS, self.epoch_seen, self.sent, len(tokens)], tokens)
            self.counts.proposed += len(tokens)
            self.sent += len(tokens)

    # -- what the two kinds of stage do
    def can_step(self) -> bool:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def begin(self, prompt_ids: list[int], seed: int) -> None:
        """The stage's device state for a new request."""
        raise NotImplementedError

    def on_adopt(self, start: int) -> None:
        """The stage's device state after its tokens changed from `start` on (cut back, extended)."""


class DraftingPeer(PipelinePeer):
    """Stage 0: drafts a chain per step into its committed tokens, or a tree that it sends and
    waits on (its committed tokens then grow only by the CHECKs that answer its trees)."""

    def __init__(self, drafter: Drafter, trees: bool, capacity: int, **common):
        super().__init__(**common)
        self.drafter, self.trees = drafter, trees
        self.stage = drafter.stage
        self.nodes = drafter.nodes
        self.sequence = Sequence(capacity, self.device)
        self.path = torch.arange(self.nodes + 1, device=self.device)  # a chain's every node, kept
        self.chain_count = torch.tensor(self.nodes, device=self.device)

    def begin(self, prompt_ids: list[int], seed: int) -> None:
        prompt = torch.tensor(prompt_ids, device=self.device)
        self.sequence.start(prompt)
        self.drafter.prefill(prompt)
        self.fed = max(0, len(prompt_ids) - CATCH_UP)
        self.sampling.seed.fill_(seed)  # (the sampling rule's key: every stage's)
        self.tree_out = False  # a tree is out, its CHECK not in yet

    def can_step(self) -> bool:
        return not self.tree_out if self.trees else self.unverified_above() < self.ahead

    def step(self) -> None:
        length = len(self.committed)
        feeds = length - self.fed
        assert 1 <= feeds <= self.drafter.max_feeds, f"stage {self.name}: {feeds} tokens to catch up"
        seq = self.sequence
        request = Requests.one(seq.tokens, seq.length, feeds)
        draft = self.drafter.draft(request, self.stage.width(length, self.drafter.span + feeds), self.sampling)
        tree = draft.tree
        tokens = tree.tokens[0]
        if self.trees:
            payload = torch.cat([tokens, tree.parents[0]]).tolist()  # the step's host read
            self.fed = length  # the catch-up fed up to the root; the nodes wait for their CHECK
            self.tree_out = True
            self.counts.proposed += self.nodes
            self.send(self.above, [TREE, self.epoch_seen, length, len(payload)], payload)
            return
        self.drafter.commit(draft, self.path[None], request)
        new = tokens[1:]  # [k]
        seq.append(new, self.chain_count)
        tokens = new.tolist()  # the step's host read
        self.committed += tokens
        self.fed = length + self.nodes - 1  # the chain's last token is fed by the next catch-up

    def on_adopt(self, start: int) -> None:
        tokens = torch.tensor(self.committed[start:], device=self.device)
        self.sequence.tokens[start : start + tokens.numel()] = tokens
        self.sequence.length.fill_(len(self.committed))
        self.tree_out = False  # the CHECK answers the tree out, or makes it stale


class VerifyingPeer(PipelinePeer):
    """Stage i > 0: verifies what the stage below sent per step — up to a window of its tokens, as
    a chain from its last committed token, or the tree a first stage sent; the last stage's
    committed tokens are the output."""

    def __init__(self, verifier: Verifier, trees_below: bool, **common):
        """`trees_below`: the stage below is a first stage that drafts trees."""
        super().__init__(**common)
        self.verifier, self.trees_below = verifier, trees_below
        self.stage = verifier.stage
        self.adoptable = len(common["names"]) - 1 - self.index  # tokens adopted, one per stage above, wait to be fed
        self.chains = {size: TreeStructure.of(list(range(-1, size - 1)), self.device)
                       for size in range(1, self.window + self.adoptable + 2)}

    def begin(self, prompt_ids: list[int], seed: int) -> None:
        self.verifier.prefill(torch.tensor(prompt_ids, device=self.device))
        self.fed = len(prompt_ids) - 1
        self.stream = stream(seed, self.index, self.device) if self.verifier.draws else None
        self.sampling.seed.fill_(seed)  # (the sampling rule's key: every stage's)
        self.tree: tuple[list[int], list[int]] | None = None  # a tree from below, unverified

    def can_step(self) -> bool:
        ready = self.tree is not None if self.trees_below else bool(self.pending)
        return ready and (self.above is None or self.unverified_above() < self.ahead)

    def receive_tree(self, epoch: int, position: int, payload: list[int]) -> None:
        if self.stopping or epoch < self.epoch_below:  # sent before our last CHECK reached it: stale
            self.counts.dropped += len(payload) // 2 - 1
            return
        if position != len(self.committed) or self.tree is not None:
            raise ProtocolError(f"stage {self.name}: a tree rooted at {position}, with {len(self.committed)} tokens")
        n = len(payload) // 2
        self.tree = (payload[:n], payload[n:])

    def drafted(self) -> tuple[list[int], list[int]]:
        """What this step verifies of what came from below: tokens and parents of a tree rooted at
        our last committed token (root included, its token a placeholder)."""
        if self.trees_below:
            return self.tree
        n = min(len(self.pending), self.window)
        return [0] + self.pending[:n], list(range(-1, n))

    def step(self) -> None:
        length = len(self.committed)
        assert self.trees_below or self.pending_at == length
        base = self.fed + 1  # the tree's root is committed[base - 1]; what follows it was adopted from above
        forced = self.committed[base:length]
        assert len(forced) <= self.adoptable, f"stage {self.name}: {len(forced)} adopted tokens to feed"
        drafted, drafted_parents = self.drafted()
        f, n = len(forced), len(drafted) - 1
        tokens = [self.committed[base - 1]] + forced + drafted[1:]
        parents = [-1] + list(range(f)) + [f + p for p in drafted_parents[1:]]  # the drafted root is our last token
        structure = TreeStructure.of(parents, self.device) if self.trees_below else self.chains[len(tokens)]
        token_tensor = torch.tensor(tokens, device=self.device)
        tree = Tree(token_tensor[None], torch.tensor([parents], device=self.device), structure)
        row, lengths = torch.zeros(1, dtype=torch.long, device=self.device), torch.tensor([base], device=self.device)
        logits, layout = self.verifier.score(tree, row, lengths, self.stage.width(base, len(tokens)))
        if forced:  # a token adopted from above is certain at its parent
            logits = logits.clone()
            certain = torch.full_like(logits[:f], float("-inf"))
            certain[torch.arange(f), token_tensor[1 : 1 + f]] = 0.0
            logits[:f] = certain
        verdict = self.verifier.verdict(tree, logits, layout, self.sampling, self.stream)
        counts, news = verdict.accepted(tree)
        count, new = counts[0], news[0]
        self.verifier.commit(verdict.paths, row, lengths)
        read = torch.cat([count.reshape(1), new, verdict.paths[0]]).tolist()  # the step's host read
        count, new, path = read[0], read[1 : 1 + new.numel()], read[1 + new.numel() :]
        new = new[:count]
        assert new[:f] == forced, "an adopted token was not kept"
        emitted = new[f:]  # the accepted drafted tokens, then this stage's own token
        accepted = len(emitted) - 1
        self.counts.verified += n
        self.counts.accepted += accepted
        last = path[f + accepted] - f  # the last accepted drafted node (0: the root): a rejection where it has children
        self.counts.rejections += last in drafted_parents[1:]
        self.committed += emitted
        self.fed = len(self.committed) - 1
        if self.trees_below:
            self.tree = None
        else:
            self.pending = self.pending[accepted:]
            self.pending_at = length + accepted
        self.reconcile()
        if self.above is None:
            self.emit(emitted)

    def reconcile(self) -> None:
        if not self.trees_below:
            return super().reconcile()
        self.tree = None  # (one in flight is stale: the CHECK opens a new epoch)
        self.check_below(self.committed[self.below_length :])
        self.below_length = len(self.committed)

    def emit(self, emitted: list[int]) -> None:
        """The last stage: `emitted` goes to the output, up to the budget or an end-of-sequence token."""
        if self.output.take(emitted):
            self.stop()


MESSAGE_TOKENS = 64  # longs a message carries at least (more tokens go as several TOKENS messages)
