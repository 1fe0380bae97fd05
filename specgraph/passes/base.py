"""What every pass shares: it declares the node attributes it requires and provides,
never mutates its input, and is checked for both."""

from __future__ import annotations

import functools
from typing import Callable

from specgraph.graph import SpecGraph

Pass = Callable[[SpecGraph], SpecGraph]


def graph_pass(requires: tuple[str, ...] = (), provides: tuple[str, ...] = ()) -> Callable[[Pass], Pass]:
    def wrap(fn: Pass) -> Pass:
        @functools.wraps(fn)
        def run(graph: SpecGraph) -> SpecGraph:
            for name in graph.stages():
                missing = [a for a in requires if a not in graph.node(name)]
                if missing:
                    raise RuntimeError(f"pass {fn.__name__} requires {missing} on stage {name}; run the passes in PIPELINE order")
            out = fn(graph.copy())
            for name in out.stages():
                absent = [a for a in provides if a not in out.node(name)]
                if absent:
                    raise RuntimeError(f"pass {fn.__name__} did not provide {absent} on stage {name}")
            return out

        run.requires, run.provides = requires, provides
        return run

    return wrap
