"""A process's watchdog state: what its main thread is doing and since when (launch.py's watchdog
thread reads it and stops a rank that waits, or steps, too long)."""

from __future__ import annotations

import contextlib
import time

FIRST_REQUEST_GRACE = 10  # the first request compiles and captures: its waits may take this many timeouts


class Progress:
    """What a rank's main thread is doing, for its watchdog: a phase ('waiting for a tree from
    stage draft (rank 1)', 'a step') and since when. Writes are single attribute assignments."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.grace = FIRST_REQUEST_GRACE
        self.state: tuple[str, float] | None = None  # None: idle (between requests), never too long

    def enter(self, phase: str) -> None:
        self.state = (phase, time.monotonic())

    def idle(self) -> None:
        self.state = None

    @contextlib.contextmanager
    def within(self, phase: str):
        """`phase` for the duration of a block inside another phase (which then goes on, its clock
        not reset): a send that blocks names whom it waits for."""
        outer = self.state
        self.enter(phase)
        try:
            yield
        finally:
            self.state = outer

    def first_request_done(self) -> None:
        self.grace = 1

    def overdue(self) -> str | None:
        state, limit = self.state, self.timeout * self.grace
        if state is not None and time.monotonic() - state[1] > limit:
            return f"{state[0]} for more than {limit:g} s (recipe timeout {self.timeout:g} s)"
        return None


PROGRESS = Progress(timeout=float("inf"))  # this process's; a rank sets its timeout when it starts
