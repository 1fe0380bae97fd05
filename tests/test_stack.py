"""specgraph/stack.py: work on a frame-stack chunk of its own maps no memory per call, at any depth."""

import resource

from specgraph.stack import on_a_stack_chunk_of_its_own


def leaf() -> None:
    pass


def calls_at(depth: int, calls: int) -> None:
    """`calls` calls of leaf() from `depth` frames down."""
    if depth:
        return calls_at(depth - 1, calls)
    for _ in range(calls):
        leaf()


def faults_of_calls_at_every_depth() -> int:
    """Minor page faults while leaf() is called 300 times at each depth up to 600 frames (past a 16 KB chunk's
    end: on CPython 3.11 and 3.12, the depth whose leaf() lands first in a new chunk maps it on every call)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for depth in range(600):
        calls_at(depth, 300)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_calls_at_any_depth_on_a_chunk_of_its_own_fault_no_pages_per_call():
    faults_of_calls_at_every_depth()  # (the first pass touches each chunk page once)
    assert on_a_stack_chunk_of_its_own(faults_of_calls_at_every_depth) < 100  # (one depth over a boundary: >= 300)
    assert on_a_stack_chunk_of_its_own(lambda: 7) == 7
