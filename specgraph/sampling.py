"""Turning logits into the distributions that drafting and verification use.

Draft and target go through the same function, so temperature, top-k and top-p
shape both identically (a requirement of lossless speculative sampling).
"""

from __future__ import annotations

import torch

from specgraph.recipe import SamplingSpec


def probs_from_logits(logits: torch.Tensor, sampling: SamplingSpec) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V]; temperature 0 gives the one-hot argmax."""
    if sampling.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= sampling.top_p  # keep the top-1 always
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def draw_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k distinct draws per row, in draw order, from probs [..., V] (Gumbel-top-k) -> [..., k].
    Past the support, the remaining picks are tokens of probability 0."""
    gumbel = -torch.empty_like(probs).exponential_(generator=generator).log()
    return (probs.log() + gumbel).topk(k, dim=-1).indices


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
