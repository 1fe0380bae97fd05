"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) for static caches and tree masks.

Parameter names follow the Hugging Face checkpoints (minus the `model.` prefix), except that
q/k/v and gate/up are stored fused, so that a decoding step reads each layer's weights in three
GEMMs (qkv, gate_up, down) and an output projection: `fuse_hf_state` and `hf_state` convert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specgraph.cache import KVCache
from specgraph.kernels import Kernels
from specgraph.layout import Layout


@dataclass(frozen=True)
class LlamaShape:
    """What our module needs from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k

    def parameter_count(self, tied: bool) -> int:
        """Parameters of a model of this shape (biases and per-head norms aside); `tied`: one embedding matrix."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * layer + self.vocab_size * h * (1 if tied else 2) + h

    def kv_bytes_per_slot(self, itemsize: int) -> int:
        """Bytes of keys and values one cached token takes over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def cache_bytes(self, slots: int, itemsize: int) -> int:
        return self.kv_bytes_per_slot(itemsize) * slots

    def new_cache(self, blocks: int, block_size: int, requests: int, dtype: torch.dtype, device: torch.device | str,
                  kernels: Kernels = Kernels()) -> KVCache:
        """A pool of `blocks` blocks for `requests` request slots; `kernels`: the stage's choice of
        kernels, which the cache runs too."""
        return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, blocks, block_size, dtype, device, kernels)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each weight a layer projects a token through, and of the logits head."""
        h, d = self.hidden_size, self.head_dim
        return {"qkv_proj": (sum(qkv_sizes(self.num_heads, self.num_kv_heads, d)), h), "o_proj": (h, self.num_heads * d),
                "gate_up_proj": (2 * self.intermediate_size, h), "down_proj": (h, self.intermediate_size),
                "lm_head": (self.vocab_size, h)}

    def fused_sizes(self) -> dict[str, list[int]]:
        return {"self_attn.qkv_proj": qkv_sizes(self.num_heads, self.num_kv_heads, self.head_dim),
                "mlp.gate_up_proj": [self.intermediate_size] * 2}


def qkv_sizes(heads: int, kv_heads: int, head_dim: int) -> list[int]:
    """Row counts of q, k and v in the fused qkv projection."""
    return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_hf_state(state: dict[str, torch.Tensor], fused_names: dict[str, tuple[str, ...]] = FUSED
                  ) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names -> ours: the parts of each fused projection concatenated by rows."""
    out = dict(state)
    for fused, parts in fused_names.items():
        for name in [n for n in state if f".{parts[0]}." in n]:  # e.g. layers.3.self_attn.q_proj.weight
            names = [name.replace(parts[0], part) for part in parts]
            if all(n in out for n in names):
                out[name.replace(parts[0], fused)] = torch.cat([out.pop(n) for n in names])
    return out


def hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our state -> Hugging Face names, as views of our tensors (no copy), for any model with
    `FUSED` (fused name -> its parts) and a shape with `fused_sizes()` (fused name -> part rows)."""
    sizes, fused_names = model.shape.fused_sizes(), model.FUSED
    out = {}
    for name, tensor in model.state_dict().items():
        fused = next((f for f in fused_names if f".{f}." in name), None)
        if fused is None:
            out[name] = tensor
            continue
        stem, kind = name.split(f"{fused}.")
        for part, piece in zip(fused_names[fused], tensor.split(sizes[fused])):
            out[f"{stem}{part}.{kind}"] = piece
    return out


class RMSNorm(nn.Module):
    """An RMSNorm's weight and eps, read by the kernel that applies it (add_rmsnorm, rope_write's per-head norms)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


def unsharded(x: torch.Tensor) -> torch.Tensor:
    """A whole layer's output needs no sum over ranks."""
    return x


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        h, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.qkv_proj = nn.Linear(shape.hidden_size, (h + 2 * kv) * d, bias=shape.qkv_bias)  # rows: q, k, v
        self.o_proj = nn.Linear(h * d, shape.hidden_size, bias=shape.o_bias)
        if shape.qk_norm:
            self.q_norm = RMSNorm(d, shape.rms_norm_eps)
            self.k_norm = RMSNorm(d, shape.rms_norm_eps)
        self.kernels = Kernels()
        self.reduce = unsharded  # tensor parallelism: the sum over ranks (see parallel.py)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, slots: torch.Tensor, attend: tuple) -> torch.Tensor:
        """x [1, T, hidden], T packed tokens; keys, values [1, Hkv, S, K]: this layer's cache, written
        in place at `slots` [T]; `attend`: the rest of the attention kernel's inputs (Layout.attention_inputs)."""
        b, t, _ = x.shape
        qkv = self.kernels.project(x, self.qkv_proj)
        q, k, v = qkv.split(qkv_sizes(self.num_heads, self.num_kv_heads, self.head_dim), dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim)  # [B, T, H, K]
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else ()
        q = self.kernels.rope_write(q, k, v, cos, sin, keys, values, slots, *norms)  # [B, H, T, K]; k, v cached
        out = self.kernels.attention(q, keys, values, *attend).transpose(1, 2).reshape(b, t, -1)  # [B, T, H K]
        return self.reduce(self.kernels.project(out, self.o_proj))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=shape.mlp_bias)  # rows: gate, up
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=shape.mlp_bias)
        self.kernels = Kernels()
        self.reduce = unsharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.kernels.project(self.kernels.gated(x, self.gate_up_proj), self.down_proj))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.kernels = Kernels()

    def forward(self, x, delta, cos, sin, keys, values, slots, attend):
        """x [B, T, hidden]: the residual stream without `delta`, the previous layer's MLP output,
        whose addition is fused with this layer's first norm. Returns this layer's (x, delta)."""
        first, second = self.input_layernorm, self.post_attention_layernorm
        x, h = self.kernels.add_rmsnorm(x, delta, first.weight, first.eps)  # x + delta, and its norm
        attended = self.self_attn(h, cos, sin, keys, values, slots, attend)
        x, h = self.kernels.add_rmsnorm(x, attended, second.weight, second.eps)
        return x, self.mlp(h)


class DecoderModel(nn.Module):
    """What our decoders share: embedding, layers, final norm and logits head, the rotary tables
    (`inv_freq` and `rope_scale` come from the checkpoint's rope config), the cache they make and
    the kernels their fused ops run through. Subclasses define `FUSED` and `forward`."""

    def __init__(self, shape, layers: nn.ModuleList, rotary_dim: int):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.register_buffer("inv_freq", torch.ones(rotary_dim // 2), persistent=False)
        self.rope_scale = 1.0
        self.served_vocab = shape.vocab_size  # logits cover token ids [0, served_vocab) (less when widened)
        self.kernels = Kernels()

    def new_cache(self, blocks: int, block_size: int, requests: int = 1, kernels: Kernels = Kernels()) -> KVCache:
        """A pool of `blocks` blocks of `block_size` slots for `requests` request slots (specgraph/layout.py)."""
        weight = self.embed_tokens.weight
        return self.shape.new_cache(blocks, block_size, requests, weight.dtype, weight.device, kernels)

    def use_kernels(self, kernels: Kernels) -> None:
        """Run every fused op (the layers', and the final add + norm) through `kernels` (before compiling the layers)."""
        for module in self.modules():
            if hasattr(module, "kernels"):
                module.kernels = kernels

    def stem(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """tokens, positions [B, T] -> the first layer's inputs: the embeddings x [B, T, hidden], a
        zero delta like x (see DecoderLayer.forward), and the rotary cos, sin [B, 1, T, R], computed
        in fp32 like the reference."""
        x = self.embed_tokens(tokens)
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return x, torch.zeros_like(x), cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]

    def logits(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The last layer's residual x and MLP output delta [B, T, hidden] -> logits [B, T, V] in fp32, V = served_vocab."""
        _, h = self.kernels.add_rmsnorm(x, delta, self.norm.weight, self.norm.eps)
        return self.kernels.project(h, self.lm_head)[..., : self.served_vocab].float()


class LlamaModel(DecoderModel):
    FUSED = FUSED

    def __init__(self, shape: LlamaShape):
        super().__init__(shape, nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers)), shape.head_dim)

    def forward(self, tokens: torch.Tensor, cache: KVCache, layout: Layout, capture: tuple[int, ...] = (),
                logits: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """tokens [1, T], packed as `layout` says (specgraph/layout.py): writes each token's K/V at its
        slot and attends over what the layout shows it. Shapes depend on the layout's sizes only.
        Returns logits [1, T, V] in fp32, V = served_vocab; with `capture` (layer indices), also
        the inputs of those layers (the residual stream), concatenated in that order [1, T, C H]:
        the features an EAGLE-3 head drafts from (models/eagle.py). Without `logits`, no vocabulary
        projection: None in the logits' place (a prompt forward wants only the K/V it writes)."""
        x, delta, cos, sin = self.stem(tokens, layout.positions[None])
        attend = layout.attention_inputs(self.shape.num_heads)
        seen = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                seen[i] = x + delta
            x, delta = layer(x, delta, cos, sin, cache.k[i], cache.v[i], layout.slots, attend)
        projected = self.logits(x, delta) if logits else None
        return (projected, torch.cat([seen[i] for i in capture], dim=-1)) if capture else projected
