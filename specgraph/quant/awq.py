"""Activation-aware weight quantization (AWQ, Lin et al., MLSys 2024) for `specgraph quantize
--method awq`: calibration prompts run through the full-precision model, and from the inputs each
projection saw, per decoder layer,
- a scale per input channel for each set of projections that read the same inputs (q/k/v or the
  gated-DeltaNet in_proj_* after the input norm, gate/up after the post-attention norm, o_proj after
  v_proj where their widths match, down_proj after up_proj): s = mean|x|^alpha, alpha searched on a
  grid for the least output error of the projections quantized with W*s (alpha 0, s = 1, is round to
  nearest: the search never does worse than it on the calibration inputs); W*s stored, 1/s folded
  into the norm or projection before, so that the model computes what it did;
- a clip of each group's range (each projection but q/k, whose errors the attention scores amplify),
  searched for the least error of that group's partial outputs.
The quantization itself stays compressed-tensors' round to nearest over the (scaled, clipped)
weights, so what `quantize_checkpoint` writes next is read as any of its checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specgraph.errors import SpecgraphError
from specgraph.kernels.linear.reference import linear_reference
from specgraph.quant.rounding import fake_quantized

GRID = 20  # points of each search
SEARCH_ROWS = 4096  # calibration tokens (rows of inputs) that the scale search reads, at most
BLOCK = 512  # tokens per calibration forward (the clip search reads the first)
TOKENS = 128 * BLOCK  # calibration tokens read, at most


@dataclass
class ScaleSet:
    """Projections that read the same inputs, and what makes those inputs: a norm (RMSNorm, or
    Qwen3.5's 1 + weight form) or a projection whose output rows are the inputs' channels."""

    before: nn.Module
    projections: list[nn.Linear]
    inputs: list[torch.Tensor]  # rows [R, K] seen by the projections, in float32 on the model's device


def scale_sets(layer: nn.Module) -> list[ScaleSet]:
    """The ScaleSets of one decoder layer (Llama and Qwen3.5 decoder layers; others raise)."""
    attention = getattr(layer, "self_attn", None) or getattr(layer, "linear_attn", None)
    mlp = getattr(layer, "mlp", None)
    if attention is None or mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        raise NotImplementedError(f"--method awq: no attention and gated MLP in {type(layer).__name__}")
    reading = [m for name, m in attention.named_children() if isinstance(m, nn.Linear) and name not in ("o_proj", "out_proj")]
    sets = [ScaleSet(layer.input_layernorm, reading, []),
            ScaleSet(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], []),
            ScaleSet(mlp.up_proj, [mlp.down_proj], [])]
    v, o = getattr(attention, "v_proj", None), getattr(attention, "o_proj", None)
    if v is not None and o is not None and v.out_features == o.in_features:  # (grouped-query attention: they differ)
        sets.append(ScaleSet(v, [o], []))
    return sets


@torch.no_grad()
def apply_awq(model: nn.Module, calibration: list[list[int]], args, progress) -> None:
    """Scale and clip `model`'s decoder-layer projections in place for quantization by `args`
    (compressed-tensors QuantizationArgs), from the token ids of the calibration prompts."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise NotImplementedError(f"--method awq: {type(model).__name__} has no decoder layers (model.layers)")
    calibration = [t for ids in calibration for t in ids][:TOKENS]
    sets = [s for layer in layers for s in scale_sets(layer)]
    clipped = [m for layer in layers for name, m in layer.named_modules()
               if isinstance(m, nn.Linear) and name.rpartition(".")[2] not in ("q_proj", "k_proj")]
    tokens = torch.tensor(calibration, device=model.device)  # [T]
    stride = -(-len(tokens) // SEARCH_ROWS)
    hooks = [s.projections[0].register_forward_pre_hook(
        lambda _, inputs, s=s: s.inputs.append(inputs[0].flatten(0, -2)[::stride].float())) for s in sets]
    try:
        before = model(tokens[None, :BLOCK]).logits.float()  # [1, BLOCK, V]: what folding must keep
        for i in range(BLOCK, len(tokens), BLOCK):
            model(tokens[None, i: i + BLOCK])
    finally:
        for hook in hooks:
            hook.remove()
    for s in progress(sets, desc="awq scales", unit="set"):
        x = torch.cat(s.inputs)  # [R, K]
        s.inputs.clear()
        fold(s, search_scale(x, s.projections, args))
    inputs = {}  # projection -> its inputs' rows, from the first block after folding (which the clips search)
    hooks = [m.register_forward_pre_hook(lambda m, x: inputs.setdefault(m, []).append(x[0].flatten(0, -2).float()))
             for m in clipped]
    try:
        after = model(tokens[None, :BLOCK]).logits.float()
    finally:
        for hook in hooks:
            hook.remove()
    change = ((after - before).norm() / before.norm()).item()
    if not change < 0.05:  # (measured on the fixtures: 0.009 in bf16, 1e-6 in float32)
        raise SpecgraphError(f"--method awq: folding the scales changed {type(model).__name__}'s logits by "
                             f"{change:.3f} of their norm (at most 0.05); quantize it with --method rtn")
    for m in progress(clipped, desc="awq clips", unit="projection"):
        clip(m, torch.cat(inputs.pop(m)), args)


def search_scale(x: torch.Tensor, projections: list[nn.Linear], args) -> torch.Tensor:
    """The scale [K] of the least error of x [R, K] through the projections quantized with their
    weights times it (their outputs' squared error, summed)."""
    weight = torch.cat([p.weight for p in projections]).float()  # [N, K]
    exact = linear_reference(x, weight, None)  # [R, N] (oneDNN on the CPU: half MKL's time at these shapes)
    magnitude = x.abs().mean(0)  # [K]
    best, best_error = torch.ones_like(magnitude), float("inf")
    for alpha in torch.arange(GRID) / GRID:  # (alpha 0 first: s = 1, round to nearest)
        s = magnitude.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        rounded = fake_quantized((weight * s).to(projections[0].weight.dtype), args) / s  # [N, K]
        error = (linear_reference(x, rounded, None) - exact).pow(2).mean()
        if error < best_error:
            best, best_error = s, error.item()
    return best


def fold(s: ScaleSet, scale: torch.Tensor) -> None:
    """Divide what makes the projections' inputs by `scale` [K] and multiply their weights by it
    along their inputs: the model's function is unchanged (up to the weights' rounding). A norm's
    multiplier is rounded to its weight's dtype first, and the projections take the division that
    rounded multiplier makes (in bf16, Qwen3.5's 1 + weight loses up to 5% of a small multiplier)."""
    before = s.before
    if isinstance(before, nn.Linear):  # its output rows are the inputs' channels
        before.weight.copy_(before.weight.float() / scale[:, None])
        if before.bias is not None:
            before.bias.copy_(before.bias.float() / scale)
    else:  # a norm: x * (offset + weight)
        offset = 1.0 if type(before).__name__ == "Qwen3_5RMSNorm" else 0.0
        old = offset + before.weight.float()  # [K]
        stored = (old / scale - offset).to(before.weight.dtype)
        vanished = (offset + stored.float() == 0) & (old != 0)  # (rounded to -offset: the next weight on old's side)
        toward = torch.where(old > 0, torch.inf, -torch.inf).to(stored.dtype)
        stored = torch.where(vanished, torch.nextafter(stored, toward), stored)
        before.weight.copy_(stored)
        new = offset + stored.float()
        scale = torch.where(new != 0, old / new, scale)
    for p in s.projections:
        p.weight.copy_(p.weight.float() * scale)


def clip(projection: nn.Linear, x: torch.Tensor, args) -> None:
    """Clamp each group of `projection`'s weight to the fraction of its range (1 down to 1/2) whose
    quantized weights give the least squared error of that group's partial outputs over x [R, K]."""
    weight = projection.weight.float()  # [N, K]
    n, k = weight.shape
    g = args.group_size or k
    xg = x.view(len(x), k // g, g)  # [R, groups, G]
    wide = weight.abs().view(n, k // g, g).amax(-1, keepdim=True)  # [N, groups, 1]
    best, best_error = wide.clone(), torch.full((n, k // g), float("inf"), device=weight.device)
    for step in range(GRID // 2 + 1):
        limit = wide * (1 - step / GRID)
        clamped = weight.view(n, k // g, g).clamp(-limit, limit).view(n, k).to(projection.weight.dtype)
        delta = (fake_quantized(clamped, args) - weight).view(n, k // g, g)
        error = sum(torch.einsum("rjg,njg->nrj", xg[i: i + 128], delta).pow(2).sum(1)  # [N, groups]
                    for i in range(0, len(x), 128))
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better[..., None], limit, best)
    projection.weight.copy_(weight.view(n, k // g, g).clamp(-best, best).view(n, k))
