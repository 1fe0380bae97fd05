"""Bole's batch-wide verification budget (its Eq. 12): with c requests in a step, verify

    B(c) = max{N : T_ver(N | c) <= (1 + epsilon) T_dec(c)}

draft nodes, the most likely of all the requests' trees, where T_dec(c) is the target's forward
of the c requests' last tokens alone and T_ver(N | c) that of the same with N draft nodes among
them. While the forward is bound by memory traffic, verifying more nodes costs almost nothing, and
the budget is large; as the batch grows, it shrinks, down to none where even one more token per
request costs more than epsilon (speculation then never slows decoding down).

The table is calibrated at batch sizes 1, 2, 4, ... (powers of two up to the engine's batch): for
each c, the target's forward is timed with 0, 1, 2, ... draft nodes per request; B(c) is the most
whose time stays within the bound. Between two calibrated sizes, a batch gets the smaller one's
nodes per request.
"""

from __future__ import annotations

import torch

from specgraph.runtime.clock import best_seconds
from specgraph.runtime.graphs import CapturedGraph
from specgraph.runtime.verifier import Verifier
from specgraph.tree import Tree, TreeStructure


class Budget:
    def __init__(self, table: dict[int, int], per_request: int):
        """`table`: B(c) at calibrated batch sizes c; `per_request`: the most nodes of one request (its tree's)."""
        self.table, self.per_request = dict(sorted(table.items())), per_request

    def __call__(self, batch: int) -> int:
        """The nodes a step of `batch` requests verifies."""
        size = max((c for c in self.table if c <= batch), default=min(self.table))
        return min(self.table[size] * batch // size, batch * self.per_request)


def batch_sizes(most: int) -> list[int]:
    """1, 2, 4, ... up to `most`, and `most` itself."""
    sizes, c = [], 1
    while c < most:
        sizes.append(c)
        c *= 2
    return [*sizes, most]


@torch.inference_mode()
def calibrate(verifier: Verifier, sizes: list[int], per_request: int, epsilon: float, context: int) -> dict[int, int]:
    """B(c) for each batch size c of `sizes`, each request at `context` committed tokens, measured
    with the verifier's stage lowered as it decodes (a CUDA graph per forward where its shapes are
    static). The requests take table rows 0 .. c - 1, whose blocks are borrowed for the timing (the
    K/V they hold is garbage; a forward's cost does not depend on it)."""
    stage, device = verifier.stage, verifier.device
    blocks = stage.table.shape[1]
    saved = stage.table.clone()
    table = {}
    try:
        for c in sizes:
            stage.table[:c] = 1 + torch.arange(c * blocks, device=device).view(c, blocks) % (stage.cache.blocks - 1)
            rows, lengths = torch.arange(c, device=device), torch.full((c,), context, device=device)

            def seconds(nodes: int) -> float:
                """The forward of c chains of `nodes` drafts after their roots."""
                parents = torch.arange(-1, nodes, device=device)[None].expand(c, -1)
                tree = Tree(torch.zeros(c, nodes + 1, dtype=torch.long, device=device), parents, None,
                            TreeStructure.of(list(range(-1, nodes)), device).expand(c))
                width = stage.width(context, nodes + 1)
                forward = lambda: verifier.score(tree, rows, lengths, width)  # noqa: E731
                if stage.static_shapes:
                    forward = CapturedGraph.record(forward, (), None)[0]
                return best_seconds(forward, device, calls=3, warmup=2)

            bound = (1 + epsilon) * seconds(0)
            within = 0
            for nodes in range(1, per_request + 1):
                if seconds(nodes) > bound:
                    break
                within = nodes
            table[c] = c * within
    finally:
        stage.table.copy_(saved)
    return table
