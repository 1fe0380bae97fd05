"""Reference of the keyed Gumbel-max: the definition the Triton kernel follows."""

from __future__ import annotations

import torch

from specgraph.draws import gumbel


def perturbed_top_reference(logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, seeds: torch.Tensor,
                            positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V]; temperature, cut [T] fp32; seeds, positions [T] long -> the k best tokens of
    each row [T, k] by score, best first, and their scores [T, k] fp32. A row's scores are x + g:
    x = logits / temperature in fp32 where x >= cut (-inf elsewhere: top-k and top-p), g the keyed
    noise of (seed, position, token); a row at temperature 0 scores its logits, unfiltered, with
    no noise (the greedy choice). Equal scores (tokens past a filter's) go to the lowest ids first."""
    x = logits.float()
    t = temperature[:, None]
    scaled = x / torch.where(t > 0, t, 1.0)
    noise = gumbel(seeds, positions, x.shape[1])  # [T, V]
    scores = torch.where(t > 0, torch.where(scaled >= cut[:, None], scaled + noise, float("-inf")), x)
    ranked = scores.sort(dim=1, descending=True, stable=True)
    return ranked.indices[:, :k], ranked.values[:, :k]
