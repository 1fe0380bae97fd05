"""Work whose Python frames sit in a frame-stack chunk of their own. CPython 3.11 and 3.12 keep frames in
16 KB chunks and free a chunk as its first frame returns, so a hot call that lands first in a chunk maps
and unmaps memory on every call (python/cpython#142183, fixed from 3.13): `specgraph compile` of the demo
recipe did so 402,000 times, xdist's test processes ran the Triton interpreter 2.4x slower. Where the
work starts (the command line, a rank, the server's engine thread) decides where its calls land; this
puts them at the start of a chunk with room for any depth they reach."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
RESERVED_SLOTS = 300_000  # more than a 16 KB chunk holds: the frame below starts a chunk of 4 MB, 1.8 MB of it free


def on_a_stack_chunk_of_its_own(call: Callable[[], T]) -> T:
    """call(), its frames after this one's, which reserves RESERVED_SLOTS (co_stacksize, below) and so
    starts a chunk of its own (pages are touched only as frames use them)."""
    return call()


on_a_stack_chunk_of_its_own.__code__ = on_a_stack_chunk_of_its_own.__code__.replace(co_stacksize=RESERVED_SLOTS)
