"""Triton keyed Gumbel-max: hash, Gumbel, filter and top-k in one pass over the logits.

A program takes one row and one block of BLOCK_V tokens (grid (T, blocks)): it hashes each token's
64 bits from the row's key (draws.py: SplitMix64's step, murmur3's finaliser), makes its Gumbel,
adds it to the scaled logit and keeps the block's k best (score, token), which is all it writes:
[T, blocks, k], never a [T, V] noise. The wrapper picks each row's k best of its blocks' (a
top-k over blocks x k values). Integer arithmetic runs in uint64 (wrapping products, logical
shifts); the Gumbel is computed by the reference's own expression, so scores agree with it to
the last bits of fp32 logarithms."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_M1, _M2, _GOLDEN = tl.constexpr(0xFF51AFD7ED558CCD), tl.constexpr(0xC4CEB9FE1A85EC53), tl.constexpr(0x9E3779B97F4A7C15)


@triton.jit
def _mix(x):
    """murmur3's 64-bit finaliser of uint64 x."""
    x = x ^ (x >> 33)
    x = x * _M1
    x = x ^ (x >> 33)
    x = x * _M2
    return x ^ (x >> 33)


@triton.jit
def _perturbed_top(logits, temperature, cut, seeds, positions, out_tokens, out_scores, V, s_l,
                   K: tl.constexpr, BLOCK_V: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    t = tl.load(temperature + i_t)
    floor = tl.load(cut + i_t)
    seed = tl.load(seeds + i_t).to(tl.uint64, bitcast=True)
    position = tl.load(positions + i_t).to(tl.uint64, bitcast=True)
    key = _mix(_mix(seed * _GOLDEN + 2) ^ position)
    cols = i_b * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = cols < V
    x = tl.load(logits + i_t * s_l + cols, mask=m_v, other=0.0).to(tl.float32)
    bits = _mix(key + (cols.to(tl.uint64) + 1) * _GOLDEN)
    w = tl.minimum(((bits >> 32).to(tl.float32) + 0.5) * 2.3283064365386963e-10, 1.0 - 5.960464477539063e-08)
    u = 1.0 - w  # log1p(-w), as draws.log1p computes it
    inner = tl.where(u == 1.0, -w, tl.log(u) * -w / (u - 1.0))
    noise = -tl.log(-inner)
    scaled = x / tl.where(t > 0, t, 1.0)
    score = tl.where(t > 0, tl.where(scaled >= floor, scaled + noise, float("-inf")), x)
    avail = m_v
    base = (i_t * tl.num_programs(1) + i_b) * K
    for i in range(K):
        best = tl.max(tl.where(avail, score, float("-inf")), axis=0)
        pick = tl.min(tl.where(avail & (score == best), cols, V), axis=0)  # the lowest id of the best
        tl.store(out_tokens + base + i, tl.where(pick < V, pick, -1))
        tl.store(out_scores + base + i, best)
        avail = avail & (cols != pick)


@torch.library.custom_op("specgraph::perturbed_top", mutates_args=())
def perturbed_top(logits: torch.Tensor, temperature: torch.Tensor, cut: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Same signature and result as perturbed_top_reference (scores to fp32 logarithms' last bits)."""
    t, v = logits.shape
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    block = min(4096, triton.next_power_of_2(v))
    blocks = triton.cdiv(v, block)
    tokens = torch.empty(t, blocks, k, dtype=torch.long, device=logits.device)  # [T, blocks, k]
    scores = torch.empty(t, blocks, k, dtype=torch.float32, device=logits.device)
    if t:
        _perturbed_top[(t, blocks)](logits, temperature.float().contiguous(), cut.float().contiguous(),
                                    seeds.contiguous(), positions.contiguous(), tokens, scores, v, logits.stride(0),
                                    K=k, BLOCK_V=block)
    # each row's k best of its blocks', best first; equal scores: the lower id first, as the reference
    flat_scores, flat_tokens = scores.flatten(1), tokens.flatten(1)  # [T, blocks k]: block order is id order
    ranked = flat_scores.sort(dim=1, descending=True, stable=True)
    return flat_tokens.gather(1, ranked.indices[:, :k]), ranked.values[:, :k].contiguous()


@perturbed_top.register_fake
def _(logits, temperature, cut, seeds, positions, k):
    t = logits.shape[0]
    return logits.new_empty(t, k, dtype=torch.long), logits.new_empty(t, k, dtype=torch.float32)
