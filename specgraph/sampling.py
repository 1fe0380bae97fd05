"""Turning logits into the distributions that drafting and verification use, per request.

Draft and target go through the same function, so temperature, top-k and top-p shape both
identically (a requirement of lossless speculative sampling). Each request of a batch has its own
settings (`SamplingRows`): a row at temperature 0 gets the one-hot argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraph.draws import Draws
from specgraph.recipe import SamplingSpec


@dataclass
class SamplingRows:
    """Sampling settings of R requests on the device; `filters`: whether any row filters by top-k or top-p."""

    temperature: torch.Tensor  # [R] float32, 0: greedy
    top_p: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] long, 0: no top-k filter
    filters: bool

    @classmethod
    def of(cls, specs: list[SamplingSpec], device: torch.device | str) -> SamplingRows:
        return cls(torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=device),
                   torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device),
                   torch.tensor([s.top_k for s in specs], dtype=torch.long, device=device),
                   any(s.top_k > 0 or s.top_p < 1 for s in specs))

    def take(self, index: torch.Tensor) -> SamplingRows:
        """The settings of rows `index` [R'] (a batch's requests from a table of them)."""
        return SamplingRows(self.temperature.index_select(0, index), self.top_p.index_select(0, index),
                            self.top_k.index_select(0, index), self.filters)


def probs_from_logits(logits: torch.Tensor, sampling: SamplingRows) -> torch.Tensor:
    """logits [R, ..., V] -> probabilities [R, ..., V] in fp32 by each row's settings; temperature 0
    gives the one-hot argmax. Top-k keeps every logit tied with the k-th; top-p then keeps the most
    likely tokens until their mass reaches top_p (the most likely always)."""
    logits = logits.float()
    shape = (logits.shape[0],) + (1,) * (logits.dim() - 1)
    temperature = sampling.temperature.view(shape)
    greedy = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # (one_hot reads the host)
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)
    if sampling.filters:
        ordered, order = scaled.sort(dim=-1, descending=True)
        k = sampling.top_k.view(shape)
        kth = ordered.gather(-1, (k - 1).clamp(min=0).expand(*ordered.shape[:-1], 1))
        ordered = ordered.masked_fill((k > 0) & (ordered < kth), float("-inf"))
        mass = ordered.softmax(-1)
        top_p = sampling.top_p.view(shape)
        ordered = ordered.masked_fill((top_p < 1) & (mass.cumsum(-1) - mass >= top_p), float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, ordered)
    return torch.where(temperature > 0, scaled.softmax(-1), greedy)


def draw_without_replacement(probs: torch.Tensor, k: int, draws: Draws) -> torch.Tensor:
    """k distinct draws per distribution, in draw order, from probs [R, E, V] (Gumbel-top-k, each
    row from its own stream) -> [R, E, k]. Past the support, the remaining picks are tokens of
    probability 0."""
    gumbel = -(-draws.uniform(*probs.shape[1:]).log()).log()
    return (probs.log() + gumbel).topk(k, dim=-1).indices
