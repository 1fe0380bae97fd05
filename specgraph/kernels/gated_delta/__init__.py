"""Gated delta rule over a tree of tokens: every node from the one committed state — in closed form
(reference.py, triton.py), or walking the tree node by node with the one-token recurrence (invariant.py)."""

from specgraph.kernels.gated_delta.reference import (gated_delta_commit_reference, gated_delta_step_reference,
                                                     gated_delta_tree_reference)

__all__ = ["gated_delta_commit_reference", "gated_delta_step_reference", "gated_delta_tree_reference"]
