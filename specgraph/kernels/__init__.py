"""Kernels: each op has reference.py (plain PyTorch, the definition) and triton.py (the fast path)
with the same signature; linear, qlinear, swiglu, attention and gated_delta also have invariant.py (Triton,
each token's row the same bits whatever the step's token count). `Kernels` is one choice per op, made by the
select_kernels pass."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specgraph.kernels.accept import accept_greedy_reference
from specgraph.kernels.attention import attention_reference
from specgraph.kernels.gumbel import perturbed_top_reference
from specgraph.kernels.gated_delta import gated_delta_commit_reference, gated_delta_step_reference
from specgraph.kernels.kv_move import kv_move_reference
from specgraph.kernels.linear import linear_reference
from specgraph.kernels.norm import add_rmsnorm_reference, rmsnorm_reference
from specgraph.kernels.qlinear import qlinear_reference
from specgraph.kernels.qlinear.tinygemm import TINYGEMM_ROWS, project_tinygemm
from specgraph.kernels.rope import rope_write_reference
from specgraph.kernels.swiglu import swiglu_reference
from specgraph.quant.linear import QuantLinear

# op -> (module of its Triton implementation, function name)
TRITON = {"attention": ("attention", "attention"), "rope_write": ("rope", "rope_write"), "linear": ("linear", "linear"),
          "qlinear": ("qlinear", "qlinear"),
          "add_rmsnorm": ("norm", "add_rmsnorm"), "rmsnorm": ("norm", "rmsnorm"),
          "swiglu": ("swiglu", "swiglu"), "kv_move": ("kv_move", "kv_move"),
          "accept_greedy": ("accept", "accept_greedy"),
          "perturbed_top": ("gumbel", "perturbed_top"),
          "gated_delta_step": ("gated_delta", "gated_delta_step"), "gated_delta_commit": ("gated_delta", "gated_delta_commit")}

# what a row-invariant stage runs: `{op}_invariant` from invariant.py where the Triton kernel's
# arithmetic depends on the row count; the Triton kernel where it does not (one program per row or element)
ROW_INVARIANT = {"linear": "invariant", "qlinear": "invariant", "swiglu": "invariant", "attention": "invariant",
                 "gated_delta_step": "invariant", "gated_delta_commit": "invariant",
                 "add_rmsnorm": "triton", "rmsnorm": "triton", "rope_write": "triton"}


def interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (TRITON_INTERPRET=1, set before any kernel module is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(x: torch.Tensor) -> str | None:
    """tl.dot's input_precision for fp32 operands made from x's values: "ieee" where x is fp32 (an
    fp32 model's products in full precision, as the reference computes them; TF32 would round
    them), else Triton's default (bf16 values are exact in TF32)."""
    return "ieee" if x.dtype == torch.float32 else None


@dataclass(frozen=True)
class Kernels:
    attention: Callable = attention_reference
    rope_write: Callable = rope_write_reference
    linear: Callable = linear_reference
    qlinear: Callable = qlinear_reference
    add_rmsnorm: Callable = add_rmsnorm_reference
    rmsnorm: Callable = rmsnorm_reference
    swiglu: Callable = swiglu_reference
    kv_move: Callable = kv_move_reference
    accept_greedy: Callable = accept_greedy_reference
    perturbed_top: Callable = perturbed_top_reference
    gated_delta_step: Callable = gated_delta_step_reference
    gated_delta_commit: Callable = gated_delta_commit_reference
    tinygemm: bool = False  # a few bf16 rows through an int4 QuantLinear's tinygemm copy (with Triton's qlinear)

    def project(self, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """x [..., K] through `module`, an nn.Linear or a QuantLinear (its weight quantized; a few bf16 rows through
        its tinygemm copy where it has one) -> [..., N]."""
        if isinstance(module, QuantLinear):
            if (self.tinygemm and module.tinygemm_weight is not None and 0 < x.numel() <= TINYGEMM_ROWS * x.shape[-1]
                    and x.dtype == torch.bfloat16):
                return project_tinygemm(x, module.tinygemm_weight, module.tinygemm_scales, module.group, module.bias)
            return self.qlinear(x, module.weight, module.scales, module.zeros, module.bias, module.format, module.group)
        return self.linear(x, module.weight, module.bias)

    def gated(self, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        """silu(gate) * up [..., I] of x [..., K] through the fused gate/up projection `module` (rows:
        gate, then up): one fused op where its weight is not quantized."""
        if isinstance(module, QuantLinear):
            gate, up = self.project(x, module).chunk(2, dim=-1)
            return F.silu(gate) * up
        return self.swiglu(x, module.weight, module.bias)

    @classmethod
    def select(cls, choice: dict[str, str]) -> Kernels:
        """choice: op -> "triton", "invariant" or "reference" (Triton modules are imported only when chosen)."""
        fast = {}
        for op, kind in choice.items():
            if kind in ("triton", "invariant"):
                module, name = TRITON[op]
                name = name if kind == "triton" else f"{op}_invariant"
                fast[op] = getattr(importlib.import_module(f"specgraph.kernels.{module}.{kind}"), name)
        return cls(**fast, tinygemm=choice.get("qlinear") == "triton")
