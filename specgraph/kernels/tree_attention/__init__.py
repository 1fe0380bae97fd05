"""Attention of draft-tree queries over a KV cache: the committed prefix plus the tree region,
under the tree's ancestor relation, without a per-head mask."""

from specgraph.kernels.tree_attention.reference import pack_ancestors, tree_attention_reference

__all__ = ["pack_ancestors", "tree_attention_reference"]
