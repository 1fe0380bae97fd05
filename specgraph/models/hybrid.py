"""Qwen3.5 hybrid decoder: gated-DeltaNet layers and gated full-attention layers, for tree steps.

A forward's tokens form a tree (a prompt chunk is a chain): attention layers write K/V at their
slots and attend under the mask, like the Llama module; gated-DeltaNet layers read the committed
recurrent state and give every node its output from it (the gated_delta_step kernel: in closed
form, or walking the tree node by node, kernels/gated_delta), leaving the nodes' factors in the
cache until `HybridCache.commit` folds the accepted path's in.

Parameter names follow the Hugging Face checkpoint (minus `model.`), with projections fused by
rows (q/gate+k+v, the DeltaNet's qkv+z+b+a, gate+up). Zero-centred RMSNorm weights (the
checkpoint's `w`, applied as 1 + w) are stored as the multiplier 1 + w, so that the norm kernels
are the Llama ones and widening rescales them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specgraph.cache import HybridCache
from specgraph.kernels import Kernels
from specgraph.layout import Layout
from specgraph.models.llama import MLP, FUSED as LLAMA_FUSED, DecoderModel, RMSNorm, qkv_sizes, unsharded

LINEAR, FULL = "linear_attention", "full_attention"
STEP_TOKENS = 128  # most tokens a forward may hold before its commit: prompt chunks, verified trees
ZERO_CENTRED_NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")  # and the final `norm`


@dataclass(frozen=True)
class HybridShape:
    """What our module needs from a Qwen3.5 text config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int  # full attention
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    linear_key_heads: int  # gated DeltaNet
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int
    rms_norm_eps: float
    mlp_bias: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layers(self) -> int:
        return self.layer_types.count(FULL)

    @property
    def linear_layers(self) -> int:
        return self.layer_types.count(LINEAR)

    @property
    def conv_channels(self) -> int:
        """The DeltaNet's convolved q, k and v channels."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    def linear_sizes(self) -> list[int]:
        """Row counts of the DeltaNet's fused input projection: convolved qkv, z, b, a."""
        v = self.linear_value_heads
        return [self.conv_channels, v * self.linear_value_dim, v, v]

    def fused_sizes(self) -> dict[str, list[int]]:
        return {"self_attn.qkv_proj": qkv_sizes(2 * self.num_heads, self.num_kv_heads, self.head_dim),
                "linear_attn.in_proj": self.linear_sizes(),
                "mlp.gate_up_proj": [self.intermediate_size] * 2}

    def parameter_count(self, tied: bool) -> int:
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (3 * self.num_heads + 2 * self.num_kv_heads) + 2 * d
        values = self.linear_value_heads * self.linear_value_dim
        linear = (h * sum(self.linear_sizes()) + self.conv_channels * self.conv_kernel + values * h
                  + 2 * self.linear_value_heads + self.linear_value_dim)
        mlp = 3 * h * self.intermediate_size + 2 * h
        layers = self.attention_layers * (attention + mlp) + self.linear_layers * (linear + mlp)
        return layers + self.vocab_size * h * (1 if tied else 2) + h

    def kv_bytes_per_slot(self, itemsize: int) -> int:
        """Bytes of keys and values one cached token takes over the attention layers."""
        return 2 * self.attention_layers * self.num_kv_heads * self.head_dim * itemsize

    def cache_bytes(self, slots: int, itemsize: int) -> int:
        """K/V of `slots` tokens plus the committed DeltaNet states (fp32) and conv windows."""
        state = 4 * self.linear_value_heads * self.linear_key_dim * self.linear_value_dim
        window = (self.conv_kernel - 1) * self.conv_channels * itemsize
        return self.kv_bytes_per_slot(itemsize) * slots + self.linear_layers * (state + window)

    def new_cache(self, blocks: int, block_size: int, requests: int, dtype: torch.dtype, device: torch.device | str,
                  kernels: Kernels = Kernels()) -> HybridCache:
        return HybridCache(self.attention_layers, self.num_kv_heads, self.head_dim, blocks, block_size, dtype, device,
                           kernels, requests=requests, linear_layers=self.linear_layers, heads=self.linear_value_heads,
                           key_dim=self.linear_key_dim, value_dim=self.linear_value_dim,
                           conv_channels=self.conv_channels, conv_kernel=self.conv_kernel, step_tokens=STEP_TOKENS)


def conv_windows(visible: torch.Tensor, kernel: int) -> torch.Tensor:
    """visible [B, T, T] bool (ancestors or self, per tree) -> [B, T, K] long: each node's conv
    inputs, oldest first, as indices into (the K - 1 committed inputs, then the step's T): the node
    and its K - 1 nearest ancestors, reaching into the committed window above the step's root. A
    padding row (seeing nothing) gets a root's: its indices in range like every other's."""
    t = visible.shape[-1]
    depth = visible.sum(-1).clamp(min=1) - 1  # [B, T]: depth in the step, root 0 (padding: 0)
    wanted = depth[..., None] - torch.arange(kernel - 1, -1, -1, device=visible.device)  # [B, T, K]
    match = visible[:, :, None, :] & (depth[:, None, None, :] == wanted[..., None])  # [B, T, K, T]: that ancestor
    node = (match.long() * torch.arange(t, device=visible.device)).sum(-1)  # [B, T, K]
    return kernel - 1 + torch.where(wanted >= 0, node, wanted)


class GatedRMSNorm(RMSNorm):
    """RMSNorm over each value head, then times silu(gate) (plain weight, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.kernels = Kernels()

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.kernels.rmsnorm(x, self.weight, self.eps, gate)


class GatedDeltaNet(nn.Module):
    def __init__(self, shape: HybridShape):
        super().__init__()
        self.shape = shape
        channels = shape.conv_channels
        self.in_proj = nn.Linear(shape.hidden_size, sum(shape.linear_sizes()), bias=False)  # rows: q k v, z, b, a
        self.conv1d = nn.Conv1d(channels, channels, shape.conv_kernel, groups=channels, bias=False)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(shape.linear_value_heads))
        self.A_log = nn.Parameter(torch.zeros(shape.linear_value_heads))
        self.norm = GatedRMSNorm(shape.linear_value_dim, shape.rms_norm_eps)
        self.out_proj = nn.Linear(shape.linear_value_heads * shape.linear_value_dim, shape.hidden_size, bias=False)
        self.kernels = Kernels()
        self.reduce = unsharded  # tensor parallelism: the sum over ranks (see parallel.py)

    def forward(self, h: torch.Tensor, windows: torch.Tensor, visible: torch.Tensor, grid: torch.Tensor,
                rows: torch.Tensor, state: torch.Tensor, conv: torch.Tensor, step_k: torch.Tensor, step_u: torch.Tensor,
                step_decay: torch.Tensor, step_inputs: torch.Tensor) -> torch.Tensor:
        """h [1, T, hidden], T packed tokens of R segments; grid [R, G]: each segment's tokens
        (Layout.grid); windows [R, G, K] (see conv_windows) and visible [R, G, G]: each segment's
        tree; rows [R]: its request slot in this layer's committed state [N, H, dk, dv] and conv
        inputs [N, K - 1, C], read only; step_* [R', STEP_TOKENS, ...]: where the step leaves the
        tokens' factors and inputs for the commit."""
        s, (_, t, _) = self.shape, h.shape
        inputs, z, write, a = self.kernels.project(h, self.in_proj).split(s.linear_sizes(), dim=-1)
        index = grid.clamp(min=0)  # [R, G]
        out = self.kernels.gated_delta_step(inputs[0][index], write[0][index], a[0][index], conv, self.conv1d.weight,
                                            self.A_log, self.dt_bias, windows, visible, state, rows, step_k, step_u,
                                            step_decay, step_inputs)  # [R, G, H, dv]
        packed = out.new_zeros(t + 1, *out.shape[2:])  # [T + 1, H, dv]: row T takes what no token is
        packed.index_copy_(0, torch.where(grid >= 0, grid, t).flatten(), out.flatten(0, 1))
        out = self.norm(packed[None, :t], z.reshape(1, t, *out.shape[2:])).reshape(1, t, -1)
        return self.reduce(self.kernels.project(out, self.out_proj))


class GatedAttention(nn.Module):
    """Full attention with per-head q/k norms, partial rotary (both in rope_write) and a sigmoid gate on the output."""

    def __init__(self, shape: HybridShape):
        super().__init__()
        h, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.qkv_proj = nn.Linear(shape.hidden_size, (2 * h + 2 * kv) * d, bias=False)  # rows: (q, gate) per head, k, v
        self.o_proj = nn.Linear(h * d, shape.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)
        self.kernels = Kernels()
        self.reduce = unsharded

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, slots: torch.Tensor, attend: tuple) -> torch.Tensor:
        """As the Llama attention; cos, sin [1, 1, T, R] rotate the first R of each head's dims."""
        b, t, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_gate, k, v = self.kernels.project(x, self.qkv_proj).split(qkv_sizes(2 * h, kv, d), dim=-1)
        q, gate = q_gate.view(b, t, h, 2 * d).chunk(2, dim=-1)  # [B, T, H, K] each
        q = self.kernels.rope_write(q, k.view(b, t, kv, d), v.view(b, t, kv, d), cos, sin, keys, values, slots,
                                    self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)  # [B, H, T, K]; k, v cached
        out = self.kernels.attention(q, keys, values, *attend).transpose(1, 2).reshape(b, t, h * d)
        out = out * torch.sigmoid(gate.reshape(b, t, h * d))
        return self.reduce(self.kernels.project(out, self.o_proj))


class HybridLayer(nn.Module):
    def __init__(self, shape: HybridShape, kind: str):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(shape)
        else:
            self.self_attn = GatedAttention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.kernels = Kernels()

    def forward(self, x: torch.Tensor, delta: torch.Tensor, *mixing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As the Llama layer: returns (x, this layer's MLP output); `mixing` are the token mixer's inputs."""
        first, second = self.input_layernorm, self.post_attention_layernorm
        mixer = self.linear_attn if self.kind == LINEAR else self.self_attn
        x, h = self.kernels.add_rmsnorm(x, delta, first.weight, first.eps)
        x, h = self.kernels.add_rmsnorm(x, mixer(h, *mixing), second.weight, second.eps)
        return x, self.mlp(h)


class HybridModel(DecoderModel):
    """`inv_freq` covers the rotary dims only."""

    FUSED = {**LLAMA_FUSED, "linear_attn.in_proj": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                                                    "linear_attn.in_proj_b", "linear_attn.in_proj_a")}

    def __init__(self, shape: HybridShape):
        super().__init__(shape, nn.ModuleList(HybridLayer(shape, kind) for kind in shape.layer_types), shape.rotary_dim)

    def forward(self, tokens: torch.Tensor, cache: HybridCache, layout: Layout, logits: bool = True
                ) -> torch.Tensor | None:
        """As LlamaModel.forward; each segment's tokens form a tree at region offsets 0, 1, ...
        (parents first: specgraph/layout.py). Leaves the DeltaNet factors in `cache` for its commit.
        Returns logits [1, T, V] in fp32 (without `logits`, None: no vocabulary projection)."""
        x, delta, cos, sin = self.stem(tokens, layout.positions[None])
        visible = layout.tree()  # [R, G, G]: ancestors or self within each segment
        windows = conv_windows(visible, self.shape.conv_kernel)
        attend = layout.attention_inputs(self.shape.num_heads)
        attention = linear = 0
        for layer in self.layers:
            if layer.kind == LINEAR:
                c = cache
                x, delta = layer(x, delta, windows, visible, layout.grid, layout.rows, c.state[linear], c.conv[linear],
                                 c.step_k[linear], c.step_u[linear], c.step_decay[linear], c.step_inputs[linear])
                linear += 1
            else:
                x, delta = layer(x, delta, cos, sin, cache.k[attention], cache.v[attention], layout.slots, attend)
                attention += 1
        return self.logits(x, delta) if logits else None


def is_zero_centred_norm(name: str) -> bool:
    return name == "norm.weight" or any(f".{n}.weight" in name for n in ZERO_CENTRED_NORMS)


def from_hf_norms(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero-centred norm weights w -> the multipliers 1 + w (in fp32, before any cast)."""
    return {n: 1 + t.float() if is_zero_centred_norm(n) else t for n, t in state.items()}


def to_hf_norms(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our multipliers m -> the checkpoint's w = m - 1 (copies for the norms, views otherwise)."""
    return {n: t - 1 if is_zero_centred_norm(n) else t for n, t in state.items()}
