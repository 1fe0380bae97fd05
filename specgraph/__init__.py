"""specgraph: graph-compiled speculative decoding of large language models."""

from specgraph.recipe import Recipe

__all__ = ["Recipe"]
