"""Turning logits into the distributions that drafting and verification use, per request.

Draft and target go through the same functions, so temperature, top-k and top-p shape both
identically. Each request of a batch has its own settings (`SamplingRows`): a row at temperature 0
gets the one-hot argmax. A request's stop tokens are kept from being drawn until it has
`min_tokens` new tokens (`forbid_stops`), in the drafter's proposals and the target's verdicts
alike, so speculation still decodes what the target alone would under that rule.

The sampling rule draws the token at sequence index t as argmax_v(log p_t(v) + g(seed, t, v)),
g the keyed Gumbel noise of draws.py (`perturbed_top`): each token follows p_t exactly, since g
at t is independent of everything before t, and it depends on the seed and p_t alone, not on
what was drafted. A drafter proposes with the same noise (the top-w of log q_t + g: Gumbel top-k,
draws without replacement from q_t), so its proposals match the target's draws often.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgraph.recipe import SamplingSpec


STOP_IDS = 16  # stop tokens a request may have (its end-of-sequence tokens and stop_token_ids)


@dataclass
class SamplingRows:
    """Sampling settings of R requests on the device; `filters`: whether any row filters by top-k or
    top-p; `forbids`: whether any row keeps its stop tokens from being drawn for a while (min_tokens):
    host flags, so that a step without either does none of that work."""

    temperature: torch.Tensor  # [R] float32, 0: greedy
    top_p: torch.Tensor  # [R] float32
    top_k: torch.Tensor  # [R] long, 0: no top-k filter
    seed: torch.Tensor  # [R] long: what keys each row's noise (draws.gumbel)
    filters: bool
    min_length: torch.Tensor  # [R] long: committed tokens (prompt and new) below which `stops` are not drawn
    stops: torch.Tensor  # [R, STOP_IDS] long: the row's stop tokens, the first repeated to fill the row
    forbids: bool = False

    @classmethod
    def of(cls, specs: list[SamplingSpec], device: torch.device | str) -> SamplingRows:
        """Rows of these settings, every stop token allowed (see `stopping`)."""
        return cls(torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=device),
                   torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device),
                   torch.tensor([s.top_k for s in specs], dtype=torch.long, device=device),
                   torch.tensor([s.seed for s in specs], dtype=torch.long, device=device),
                   any(s.top_k > 0 or s.top_p < 1 for s in specs),
                   torch.zeros(len(specs), dtype=torch.long, device=device),
                   torch.zeros(len(specs), STOP_IDS, dtype=torch.long, device=device))

    def take(self, index: torch.Tensor) -> SamplingRows:
        """The settings of rows `index` [R'] (a batch's requests from a table of them)."""
        return SamplingRows(self.temperature.index_select(0, index), self.top_p.index_select(0, index),
                            self.top_k.index_select(0, index), self.seed.index_select(0, index), self.filters, self.min_length.index_select(0, index),
                            self.stops.index_select(0, index), self.forbids)


def stopping(stops: tuple[int, ...], min_length: int) -> tuple[int, list[int]]:
    """A request's `min_length` and `stops` rows: its stop tokens (at most STOP_IDS, the first
    repeated to fill the row), kept from being drawn below `min_length` committed tokens; with no
    stop tokens, nothing is kept (min_length 0)."""
    if not stops:
        return 0, [0] * STOP_IDS
    return min_length, [*stops, *stops[:1] * (STOP_IDS - len(stops))]


def forbid_stops(logits: torch.Tensor, sampling: SamplingRows, at: torch.Tensor) -> torch.Tensor:
    """logits [R, ..., V] of the tokens that rows would commit at sequence index `at` [R, ...] ->
    the same with each row's stop tokens at -inf where `at` is below its min_length (out of place)."""
    extra = (1,) * (at.dim() - 1)
    banned = (at < sampling.min_length.view(-1, *extra))[..., None]  # [R, ..., 1]
    stops = sampling.stops.view(-1, *extra, STOP_IDS).expand(*at.shape, STOP_IDS)  # [R, ..., S]
    return logits.scatter(-1, stops, torch.where(banned, float("-inf"), logits.gather(-1, stops)))


def scaled_logits(logits: torch.Tensor, sampling: SamplingRows) -> torch.Tensor:
    """logits [R, ..., V] -> fp32 logits / temperature (a row at temperature 0: as they are)."""
    temperature = sampling.temperature.view(_row_shape(logits))
    return logits.float() / torch.where(temperature > 0, temperature, 1.0)


def cutoff(scaled: torch.Tensor, sampling: SamplingRows) -> torch.Tensor:
    """The least scaled logit that each row's filters keep: scaled [R, ..., V] -> [R, ..., 1]
    (-inf where nothing is filtered). Top-k keeps the k-th largest and all above; top-p then keeps
    the most likely tokens until their mass reaches top_p (the most likely always); every token
    tied with the last one kept is kept."""
    if not sampling.filters:
        return torch.full_like(scaled[..., :1], float("-inf"))
    shape = _row_shape(scaled)
    ordered = scaled.sort(dim=-1, descending=True).values
    k = sampling.top_k.view(shape)
    kth = ordered.gather(-1, (k - 1).clamp(min=0).expand(*ordered.shape[:-1], 1))
    ordered = ordered.masked_fill((k > 0) & (ordered < kth), float("-inf"))
    mass = ordered.softmax(-1)
    top_p = sampling.top_p.view(shape)
    kept = ~((top_p < 1) & (mass.cumsum(-1) - mass >= top_p)) & (ordered > float("-inf"))
    kept[..., 0].fill_(True)  # (fill_: no host value copied in)
    return ordered.gather(-1, kept.sum(-1, keepdim=True) - 1)  # the last kept (kept is a prefix of the order)


def probs_from_logits(logits: torch.Tensor, sampling: SamplingRows) -> torch.Tensor:
    """logits [R, ..., V] -> probabilities [R, ..., V] in fp32 by each row's settings (`cutoff`);
    temperature 0 gives the one-hot argmax."""
    temperature = sampling.temperature.view(_row_shape(logits))
    greedy = torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scaled = scaled_logits(logits, sampling)
    scaled = scaled.masked_fill(scaled < cutoff(scaled, sampling), float("-inf"))
    return torch.where(temperature > 0, scaled.softmax(-1), greedy)


def perturbed_top(logits: torch.Tensor, sampling: SamplingRows, positions: torch.Tensor, k: int,
                  kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best tokens of each distribution by perturbed score, best first, and their scores:
    logits [R, ..., V] of the tokens at sequence indices `positions` [R, ...] -> tokens, scores
    [R, ..., k]. A score is log p(v) + g(seed, position, v), p by the row's settings (fp32; -inf
    outside p's support); at temperature 0, the logit (the greedy choice, no noise). `kernel`: a
    Kernels.perturbed_top."""
    shape = logits.shape[:-1]
    scaled = scaled_logits(logits, sampling)
    cut = cutoff(scaled, sampling)  # [R, ..., 1]
    kept = scaled.masked_fill(scaled < cut, float("-inf"))
    norm = torch.where(sampling.temperature.view(_row_shape(logits)) > 0, kept.logsumexp(-1, keepdim=True), 0.0)
    rows = sampling.temperature.new_ones(shape)  # [R, ...]: broadcasts each row's settings
    t = sampling.temperature.view(_row_shape(rows)) * rows
    seeds = sampling.seed.view(_row_shape(rows)) * rows.long()
    tokens, scores = kernel(logits.reshape(-1, logits.shape[-1]), t.flatten(), cut.flatten(), seeds.flatten(),
                            positions.expand(shape).flatten(), k)  # [R ..., k]
    return tokens.view(*shape, k), scores.view(*shape, k) - norm


def _row_shape(x: torch.Tensor) -> tuple[int, ...]:
    """A per-row tensor's view that broadcasts over x [R, ...]."""
    return (x.shape[0],) + (1,) * (x.dim() - 1)

