"""Random numbers for a batch of requests, from counter hashes: nothing depends on the other rows,
so a request samples the same tokens alone or in any batch, and a step that draws is a fixed
sequence of device operations (a CUDA graph can hold it).

Two kinds:
- `Draws`, a stream per request: its n-th number is murmur3's 64-bit finaliser of (seed, n), its
  top 24 bits a uniform in (0, 1). What a request draws depends on how many it drew before (the
  typical rule's bonus tokens, one a verification step).
- `gumbel(seed, position, token)`, keyed noise: a standard Gumbel per (seed, absolute sequence
  index, token id), the same whatever drew before. A token sampled as argmax(log p + g) at its
  position depends on the seed and the distribution alone (the sampling rule, sampling.py).
  `row_key` mixes (seed, position) once per row, `token_bits` gives each token 64 bits
  (SplitMix64's step from the row key), of which the top 32 make the Gumbel.

Signed int64 arithmetic wraps on every device torch runs on; right shifts are arithmetic, so each
is masked to act as a logical one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M1, _M2 = 0xFF51AFD7ED558CCD - (1 << 64), 0xC4CEB9FE1A85EC53 - (1 << 64)  # murmur3 fmix64, as signed int64
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # spreads seeds apart before mixing; SplitMix64's step
_KEYED = 2  # what tells keyed noise from a stream of the same seed (a stream adds 1)


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shift(x, 33)
    x = x * _M1
    x = x ^ _shift(x, 33)
    x = x * _M2
    return x ^ _shift(x, 33)


@dataclass
class Draws:
    seeds: torch.Tensor  # [R] long
    counters: torch.Tensor  # [R] long: numbers drawn so far

    @classmethod
    def of(cls, seeds: list[int], device: torch.device | str) -> Draws:
        seeds = torch.tensor(seeds, dtype=torch.long, device=device)
        return cls(seeds, torch.zeros_like(seeds))

    def uniform(self, *shape: int) -> torch.Tensor:
        """[R, *shape] float32 uniforms in (0, 1), each row from its own stream; advances the counters."""
        count = 1
        for n in shape:
            count *= n
        index = self.counters[:, None] + torch.arange(count, device=self.seeds.device)  # [R, n]
        bits = _mix(_mix(self.seeds[:, None] * _GOLDEN + 1) ^ index)
        self.counters += count
        return ((_shift(bits, 40).float() + 0.5) / (1 << 24)).view(-1, *shape)


def row_key(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The key of each row's noise: seeds and positions [...] long (broadcast) -> [...] long."""
    return _mix(_mix(seeds * _GOLDEN + _KEYED) ^ positions)


def token_bits(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """64 random bits per (row, token): keys [...], tokens [...] long (broadcast) -> [...] long."""
    return _mix(keys + (tokens + 1) * _GOLDEN)


def gumbel_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """Standard Gumbels [...] fp32 from 64-bit values [...]: the top 32 bits make w in (0, 1),
    precise near 0 (the Gumbel's upper tail, which decides argmaxes), and g = -log(-log(1 - w)),
    the inner log as log1p(-w) (the kernel computes the same expression)."""
    w = ((_shift(bits, 32).float() + 0.5) * 2.0 ** -32).clamp(max=1 - 2.0 ** -24)
    return -(-log1p(-w)).log()


def log1p(x: torch.Tensor) -> torch.Tensor:
    """log(1 + x) for fp32 x > -1, to fp32 precision near 0 (Goldberg's: log(u) x / (u - 1), u = 1 + x
    rounded), with plain operations a Triton kernel repeats."""
    u = 1.0 + x
    return torch.where(u == 1.0, x, u.log() * x / (u - 1.0))


def gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The keyed noise g(seed, position, token): seeds and positions [...] long (broadcast) -> [..., vocab] fp32."""
    keys = row_key(seeds, positions)[..., None]
    return gumbel_of_bits(token_bits(keys, torch.arange(vocab, device=keys.device)))
