"""Random numbers for a batch of requests: each row's depend only on its seed and on how many it
has drawn before, never on the other rows, so a request samples the same tokens alone or in any
batch, and a step that draws is a fixed sequence of device operations (a CUDA graph can hold it).

The generator is a counter hash: the n-th number of a row is murmur3's 64-bit finaliser of
(seed, n), its top 24 bits a uniform in (0, 1). Signed int64 arithmetic wraps on every device
torch runs on; right shifts are arithmetic, so each is masked to act as a logical one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M1, _M2 = 0xFF51AFD7ED558CCD - (1 << 64), 0xC4CEB9FE1A85EC53 - (1 << 64)  # murmur3 fmix64, as signed int64
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # spreads seeds apart before mixing


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
