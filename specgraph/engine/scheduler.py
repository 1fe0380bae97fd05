"""Which requests a step admits, prefills and decodes: pure Python, no device.

Requests are admitted first come, first served while a request slot is free and the pool can
give the request every block its longest sequence needs (pool.py); the first that cannot waits,
and so do those behind it, so a long request is not starved by short ones. Each step feeds the
admitted requests still prefilling, earliest first, a chunk of prompt tokens in all (so newcomers
stall the running requests for one chunk at most, and many short prompts go in together), and
decodes every request whose prompt is in.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from specgraph.engine.pool import BlockPool
from specgraph.engine.request import DECODE, FINISHED, PREFILL, WAITING, Request


class Scheduler:
    def __init__(self, pool: BlockPool, slots: int, slots_needed: Callable[[Request], int]):
        """`slots`: requests in flight at most; `slots_needed(request)`: the virtual slots its
        longest sequence needs in the cache."""
        self.pool, self.slots_needed = pool, slots_needed
        self.limit = slots  # requests admitted at once at most (a benchmark lowers it)
        self.waiting: deque[Request] = deque()
        self.admitted: list[Request] = []  # in admission order
        self._free_slots = list(range(slots - 1, -1, -1))

    def add(self, request: Request) -> None:
        if self.pool.blocks_for(self.slots_needed(request)) > self.pool.blocks - 1:
            raise ValueError(f"request {request.id} needs more blocks than the pool has")
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Admit waiting requests, first come first served, while a slot and their blocks are free."""
        admitted = []
        while self.waiting and self._free_slots and len(self.admitted) < self.limit:
            blocks = self.pool.allocate(self.slots_needed(self.waiting[0]))
            if blocks is None:
                break
            request = self.waiting.popleft()
            request.slot, request.blocks, request.status = self._free_slots.pop(), blocks, PREFILL
            self.admitted.append(request)
            admitted.append(request)
        return admitted

    def prefilling(self) -> list[Request]:
        """The admitted requests whose prompts are not all in, earliest first."""
        return [r for r in self.admitted if r.status == PREFILL]

    def decoding(self) -> list[Request]:
        return [r for r in self.admitted if r.status == DECODE]

    def finish(self, request: Request) -> None:
        """The request is done (or aborted): its slot and blocks go to the next."""
        if request.status == WAITING:
            self.waiting.remove(request)
        elif request.status != FINISHED:
            self.admitted.remove(request)
            self.pool.release(request.blocks)
            self._free_slots.append(request.slot)
            request.blocks, request.slot = [], None
        request.status = FINISHED

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.admitted)
