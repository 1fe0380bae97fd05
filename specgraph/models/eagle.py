"""EAGLE-3 draft heads (Llama family): one decoder layer that drafts from the target's own hidden states.

A head reads pairs: the target's features at token p (the inputs of three of its layers,
concatenated, [3 Ht]) fused by `fc` into the head's width H, and the embedding of token p + 1; from
them it predicts token p + 2. Its one layer (`midlayer` in the published checkpoints) attends over
the pairs before it with q/k/v reading [input_layernorm(embedding), hidden_norm(hidden)] (2H wide)
and keeps `hidden` as its residual stream; its output, before the final norm, stands in for the
target's features when the head drafts past the committed tokens. Its logits cover a reduced
vocabulary: draft id d is target id d + d2t[d] (`t2d` marks the target ids it covers).

Parameter names are the published checkpoints' (fc, midlayer.*, norm, lm_head, d2t, t2d, and
embed_tokens where a head has its own: most share the target's), but for `layers.0.` in place of
`midlayer.` (so that the decoders' lowering applies: compile, kernels, cache) and q/k/v and
gate/up stored fused like llama.py's: `from_published` and `to_published` convert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specgraph.errors import CheckpointError
from specgraph.kernels import Kernels
from specgraph.layout import Layout
from specgraph.models.llama import FUSED, MLP, Attention, DecoderModel, LlamaShape, RMSNorm

ARCHITECTURE = "LlamaForCausalLMEagle3"
OLDER = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")  # EAGLE-1/2 heads: refused by name (loader.read_config)
PUBLISHED_LAYER, OUR_LAYER = "midlayer.", "layers.0."


def default_features(target_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs an EAGLE-3 head reads where its config names none (vLLM's and
    SGLang's default): an early, a middle and a late one."""
    return 2, target_layers // 2, target_layers - 3


@dataclass(frozen=True)
class HeadShape:
    """What a head needs from its config besides its layer's LlamaShape."""

    layer: LlamaShape  # the one decoder layer (num_layers 1; vocab_size: the target's vocabulary)
    target_hidden_size: int  # Ht: the width of each target feature
    draft_vocab_size: int
    features: tuple[int, ...] | None  # the target layers whose inputs it reads (None: default_features)


class Midlayer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        h = shape.hidden_size
        self.self_attn = Attention(shape)
        self.self_attn.qkv_proj = nn.Linear(2 * h, self.self_attn.qkv_proj.out_features, bias=shape.qkv_bias)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(h, shape.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, shape.rms_norm_eps)
        self.kernels = Kernels()

    def forward(self, embeds, hidden, cos, sin, keys, values, slots, attend):
        """embeds, hidden [1, T, H] -> the layer's output [1, T, H]: hidden + attention + MLP."""
        first, second, third = self.input_layernorm, self.hidden_norm, self.post_attention_layernorm
        e = self.kernels.rmsnorm(embeds, first.weight, first.eps)
        h = self.kernels.rmsnorm(hidden, second.weight, second.eps)
        attended = self.self_attn(torch.cat([e, h], dim=-1), cos, sin, keys, values, slots, attend)  # [1, T, H]
        x, normed = self.kernels.add_rmsnorm(hidden, attended, third.weight, third.eps)
        return x + self.mlp(normed)


class Eagle3Head(DecoderModel):
    FUSED = FUSED

    def __init__(self, head: HeadShape):
        super().__init__(head.layer, nn.ModuleList([Midlayer(head.layer)]), head.layer.head_dim)
        self.head = head
        h, width = head.layer.hidden_size, head.target_hidden_size
        self.fc = nn.Linear(3 * width, h, bias=False)
        self.lm_head = nn.Linear(h, head.draft_vocab_size, bias=False)
        self.served_vocab = head.draft_vocab_size  # draft ids it proposes (less when widened)
        self.target_vocab = head.layer.vocab_size  # the width of its logits: target ids [0, target_vocab) (less when widened)
        self.register_buffer("d2t", torch.zeros(head.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(head.layer.vocab_size, dtype=torch.bool))
        self.shares_embedding = True  # embed_tokens is the target's (set by the lowering) unless the checkpoint has one

    def tie_embedding(self, weight: torch.Tensor) -> None:
        """Read the target's embedding weight [V, H] where the checkpoint has none of its own: shared
        where it is the head's shape; written into the leading block of a widened head's (in a
        process without its target: the small target's, from its checkpoint)."""
        if not self.shares_embedding:
            return
        own = self.embed_tokens.weight
        if weight.shape == own.shape:
            self.embed_tokens.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, False)
        elif self.target_vocab < own.shape[0] and weight.shape[0] <= own.shape[0] and weight.shape[1] <= own.shape[1]:
            with torch.no_grad():
                own[: weight.shape[0], : weight.shape[1]] = weight
        else:
            raise CheckpointError(f"an EAGLE-3 head of width {own.shape[1]} and vocabulary {own.shape[0]} shares its "
                                  f"target's embedding, which is {weight.shape[1]} wide over {weight.shape[0]} ids")

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., 3 Ht] -> the head's hidden input [..., H]."""
        return self.kernels.project(features, self.fc)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, cache, layout: Layout, logits: bool = True
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """tokens [1, T] and the hidden input of each [1, T, H] (fused target features, or the
        head's own output at the token before), placed as `layout` says -> logits [1, T, V] in
        fp32 over the target's vocabulary (-inf where the head has no id; None where not `logits`:
        a feed that only fills the cache) and the output [1, T, H]."""
        embeds, _, cos, sin = self.stem(tokens, layout.positions[None])
        out = self.layers[0](embeds, hidden, cos, sin, cache.k[0], cache.v[0], layout.slots,
                             layout.attention_inputs(self.shape.num_heads))
        if not logits:
            return None, out
        draft = self.logits(out, torch.zeros_like(out))  # [1, T, Vd]
        logits = draft.new_full((*draft.shape[:-1], self.target_vocab), float("-inf"))
        return logits.index_copy_(-1, self.target_ids(), draft), out

    def target_ids(self) -> torch.Tensor:
        """[served_vocab]: the target id of each draft id served (all but a widened head's padding)."""
        return torch.arange(self.served_vocab, device=self.d2t.device) + self.d2t[: self.served_vocab]


def from_published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A published checkpoint's names -> ours (before fusing: loader.fuse_hf_state)."""
    return {OUR_LAYER + n.removeprefix(PUBLISHED_LAYER) if n.startswith(PUBLISHED_LAYER) else n: t
            for n, t in state.items()}


def to_published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our unfused names (llama.hf_state) -> the published checkpoints'."""
    return {PUBLISHED_LAYER + n.removeprefix(OUR_LAYER) if n.startswith(OUR_LAYER) else n: t for n, t in state.items()}

