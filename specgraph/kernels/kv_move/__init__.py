"""KV compaction: move the accepted path's cache rows to the end of the committed prefix."""

from specgraph.kernels.kv_move.reference import kv_move_reference

__all__ = ["kv_move_reference"]
