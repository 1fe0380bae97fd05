"""Typed messages between stages, over torch.distributed point to point: a disaggregated
program's trees and verdicts (`Link`), a pipeline's mailbox (`Mailbox`).

A `Link` joins the leaders (first ranks) of two stages: NCCL between two different GPUs (the
message never leaves the device), gloo through CPU tensors otherwise (the CPU, or two stages
sharing one GPU as separate processes, which one NCCL communicator cannot hold). The receiving
leader passes each message on to the rest of its stage (a tensor-parallel group) by broadcast, so
every rank of a stage sees the same messages and takes the same decisions.

Every message carries the committed length it continues from, and the receiver checks it
against its own (`continues`): a tree must be rooted at the target's last committed token, a
verdict must answer the tree rooted there. The check is a device flag that the receiver reads
with its step's one host read, so it costs no extra synchronisation.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specgraph.errors import SpecgraphError
from specgraph.runtime.ranks import Ranks


class ProtocolError(SpecgraphError):
    """A message that does not fit its receiver's state (a bug, never a user's mistake)."""


@dataclass
class TreeMessage:
    """A draft tree, drafter -> verifier: `base` [] the committed length L it is rooted at (the root
    is committed[L - 1]), `tokens` and `parents` [N + 1] (topological, root first, parents[0] = -1)."""

    base: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor

    def pack(self) -> torch.Tensor:
        return torch.cat([self.base.reshape(1), self.tokens, self.parents])  # [2 N + 3] long

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> TreeMessage:
        n = (packed.numel() - 1) // 2
        return cls(packed[0], packed[1 : n + 1], packed[n + 1 :])

    def continues(self, length: torch.Tensor) -> torch.Tensor:
        return self.base == length


@dataclass
class VerdictMessage:
    """A verdict, verifier -> drafter: `base` [] the committed length L of the tree it answers,
    `count` [] the new tokens (accepted drafts + the bonus), `stop` [] whether decoding ends here
    (budget, end of sequence or the end of the caches), `path` [D + 1] the accepted nodes of the
    tree (root first, -1 padded) and `new` [D + 1] the new tokens (padded)."""

    base: torch.Tensor
    count: torch.Tensor
    stop: torch.Tensor
    path: torch.Tensor
    new: torch.Tensor

    def pack(self) -> torch.Tensor:
        head = torch.stack([self.base, self.count, self.stop.long()])
        return torch.cat([head, self.path, self.new])  # [2 D + 5] long

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> VerdictMessage:
        d = (packed.numel() - 3) // 2
        return cls(packed[0], packed[1], packed[2] != 0, packed[3 : d + 3], packed[d + 3 :])

    def continues(self, length: torch.Tensor) -> torch.Tensor:
        return self.base == length


class Link:
    """Messages from stage `src` to stage `dst` of a multi-process program, as one rank sees them:
    the source leader sends, the destination's ranks receive (its leader from the source, the
    others by broadcast); ranks of neither stage do nothing."""

    def __init__(self, ranks: Ranks, src: str, dst: str, devices: dict[str, torch.device]):
        """`devices`: each stage's leader device."""
        self.ranks, self.src, self.dst = ranks, src, dst
        self.src_rank, self.dst_rank = ranks.leader(src), ranks.leader(dst)
        a, b = devices[src], devices[dst]
        self.on_device = a.type == b.type == "cuda" and a != b  # NCCL between two GPUs
        self.group = ranks.groups[dst]
        self.dst_broadcasts = len(ranks.stage_ranks[dst]) > 1

    def send(self, *tensors: torch.Tensor) -> None:
        """On the source leader: send `tensors` (fixed shapes, known to the receiver) in order."""
        if self.ranks.rank != self.src_rank:
            return
        for tensor in tensors:
            if self.on_device:
                dist.isend(tensor.contiguous(), self.dst_rank).wait()  # the stream waits; the host does not
            else:
                dist.send(tensor.cpu(), self.dst_rank)

    def recv(self, *buffers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """On the destination's ranks: fill `buffers` (on this rank's device) in order and return them."""
        if not self.ranks.runs(self.dst):
            return buffers
        for buffer in buffers:
            if self.ranks.rank == self.dst_rank:
                if self.on_device:
                    dist.irecv(buffer, self.src_rank).wait()  # the stream waits; the host does not
                else:
                    landing = torch.empty_like(buffer, device="cpu")
                    dist.recv(landing, self.src_rank)
                    buffer.copy_(landing)
            if self.dst_broadcasts:
                self._broadcast(buffer)
        return buffers

    def _broadcast(self, buffer: torch.Tensor) -> None:
        if buffer.device.type == "cuda" and dist.get_backend(self.group) == "nccl":
            dist.broadcast(buffer, self.dst_rank, group=self.group)
            return
        landing = buffer.cpu()
        dist.broadcast(landing, self.dst_rank, group=self.group)
        buffer.copy_(landing)



@dataclass
class Mail:
    """A pipeline message as its receiver sees it: `src` rank, `header` [kind, epoch, position,
    count] and its `payload` (count longs)."""

    src: int
    header: list[int]
    payload: list[int]


class Mailbox:
    """A pipeline stage leader's messages to and from the stages beside it: small host tensors over
    a gloo group (the decisions they drive are the host's). A message is one long tensor, a header
    of HEADER longs and room for `capacity` longs of payload. A thread receives them (from any
    sender; per sender in the order sent) for one request, until it has seen `finals` messages that
    end it, so that the stage can look at its inbox without waiting."""

    HEADER = 4

    def __init__(self, group: dist.ProcessGroup, capacity: int):
        self.group, self.capacity = group, capacity
        self._inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def send(self, dst: int, header: list[int], payload: list[int] = ()) -> None:
        """`header[3]` is the length of `payload` (at most `capacity`)."""
        assert len(header) == self.HEADER and header[3] == len(payload) <= self.capacity
        message = torch.zeros(self.HEADER + self.capacity, dtype=torch.long)
        message[: self.HEADER + len(payload)] = torch.tensor(header + list(payload))
        dist.send(message, dst, group=self.group, tag=0)

    def open(self, finals: int, is_final) -> None:
        """Start receiving one request's messages: until `finals` of them satisfy `is_final(header)`."""
        assert self._thread is None, "the last request's messages were not all received"
        self._thread = threading.Thread(target=self._receive, args=(finals, is_final), daemon=True)
        self._thread.start()

    def get(self, block: bool) -> Mail | None:
        """The next message (None if there is none and `block` is false)."""
        try:
            mail = self._inbox.get(block=block)
        except queue.Empty:
            return None
        if isinstance(mail, Exception):
            raise mail
        return mail

    def close(self) -> None:
        """End of the request: every message of it has been received."""
        self._thread.join()
        self._thread = None
        assert self._inbox.empty(), "messages past the end of a request"

    def _receive(self, finals: int, is_final) -> None:
        try:
            while finals:
                message = torch.zeros(self.HEADER + self.capacity, dtype=torch.long)
                src = dist.recv(message, None, group=self.group, tag=0)
                header = message[: self.HEADER].tolist()
                payload = message[self.HEADER : self.HEADER + header[3]].tolist()
                self._inbox.put(Mail(src, header, payload))
                finals -= bool(is_final(header))
        except Exception as exc:  # a dead peer: the stage's next look at its inbox raises it
            self._inbox.put(exc)
