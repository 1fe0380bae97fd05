"""Bole's batch-wide verification budget (its Eq. 12): with c requests in a step, verify

    B(c) = max{N : T_ver(N | c) <= (1 + epsilon) T_dec(c)}

draft nodes, the most likely of all the requests' trees, where T_dec(c) is the target's part of a
plain decoding step of c requests and T_ver(N | c) that of a speculative step with N draft nodes
among them. While the forward is bound by memory traffic, verifying more nodes costs almost
nothing, and the budget is large; as the batch grows, it shrinks, down to none where even one more
token per request costs more than epsilon.

The table is calibrated at batch sizes 1, 2, 4, ... (powers of two up to the engine's batch:
`batch_sizes`) on the engine's own steps (calibrate.py). A batch between two calibrated sizes gets
the larger one's nodes per request, and a request's share never grows with the batch, so that a
bigger batch never verifies more nodes per request than a smaller one.
"""

from __future__ import annotations


class Budget:
    def __init__(self, table: dict[int, int], per_request: int):
        """`table`: B(c) at calibrated batch sizes c; `per_request`: the most nodes of one request (its tree's)."""
        self.table, self.per_request = dict(sorted(table.items())), per_request
        self._shares, least = {}, float("inf")  # each calibrated size's nodes per request, never growing
        for size, nodes in self.table.items():
            least = min(least, nodes / size)
            self._shares[size] = least

    def __call__(self, batch: int, per_request: int | None = None) -> int:
        """The nodes a step of `batch` requests verifies (each at most `per_request`, default its tree's)."""
        size = next((c for c in self._shares if c >= batch), max(self._shares))
        return min(int(self._shares[size] * batch), batch * (per_request or self.per_request))


def batch_sizes(most: int) -> list[int]:
    """1, 2, 4, ... up to `most`, and `most` itself."""
    sizes, c = [], 1
    while c < most:
        sizes.append(c)
        c *= 2
    return [*sizes, most]
