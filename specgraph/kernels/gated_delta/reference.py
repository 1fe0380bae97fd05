"""Reference gated-delta tree verification and commit (fp32, plain PyTorch).

A gated-DeltaNet head keeps a state S [dk, dv] and, per token (query q, unit key k, value v,
log-decay g <= 0, write strength beta), updates and reads it:
    S_t = exp(g_t) S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),   o_t = S_t^T q_t.
Over a tree of tokens each node continues its parent's state. With G_i the summed log-decay
along node i's path in the step (itself included), unrolling the recurrence gives, from the one
state S committed before the step (Bole, Theorem 1):
    u_i + sum_{j strict ancestor} beta_i e^{G_i - G_j} (k_i . k_j) u_j = beta_i (v_i - e^{G_i} S^T k_i)
    o_i = e^{G_i} S^T q_i + sum_{j ancestor or i} e^{G_i - G_j} (q_i . k_j) u_j
The first is (I + A) U = R with A strictly lower-triangular (parents come first): one triangular
solve, by forward substitution (stable on long chains, where the Neumann series (I + A)^-1 =
sum (-A)^n cancels catastrophically in fp32). No per-node state is formed;
the step keeps the token factors (k, u, G) and committing a path builds only its last node's state.

`gated_delta_step_reference` is a whole layer step around that solve — each node's short
convolution over its ancestor window, the q/k normalisation, the gates — and
`gated_delta_commit_reference` folds an accepted path into the state and the conv window: the
definitions that kernels/gated_delta/triton.py fuses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gated_delta_tree_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor, visible: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [B, T, H, dk] (k unit-norm, q scaled), v [B, T, H, dv], g, beta [B, T, H], all fp32;
    state [B, H, dk, dv] fp32, the state before the step; visible [T, T] bool: node j is node i
    or one of its ancestors (parents come before children).
    Returns outputs [B, T, H, dv], factors u [B, T, H, dv] and path log-decays G [B, T, H]."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
    t = visible.shape[0]
    path_decay = g @ visible.T.to(g.dtype)  # [B, H, T]: G_i = sum of g_j over i's path
    decay = torch.where(visible, path_decay[..., :, None] - path_decay[..., None, :], -math.inf).exp()  # [B, H, T, T]
    strict = visible & ~torch.eye(t, dtype=torch.bool, device=visible.device)
    interaction = torch.where(strict, beta[..., None] * decay * (k @ k.transpose(-1, -2)), 0.0)  # A [B, H, T, T]
    start = path_decay.exp()[..., None]  # [B, H, T, 1]
    factors = beta[..., None] * (v - start * (k @ state))  # R [B, H, T, dv]
    # A lone node has no ancestor in the step (U = R); an exported program takes every T through one
    # graph, where solving with the identity gives the same U.
    if t > 1 or torch.compiler.is_exporting():
        eye = torch.eye(t, dtype=interaction.dtype, device=interaction.device)
        factors = torch.linalg.solve_triangular(eye + interaction, factors, upper=False, unitriangular=True)  # U
    out = start * (q @ state) + (decay * (q @ k.transpose(-1, -2))) @ factors  # [B, H, T, dv]
    return out.transpose(1, 2), factors.transpose(1, 2), path_decay.transpose(1, 2)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_step_reference(inputs: torch.Tensor, write: torch.Tensor, decay_input: torch.Tensor,
                               conv: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                               dt_bias: torch.Tensor, windows: torch.Tensor, visible: torch.Tensor,
                               state: torch.Tensor, step_k: torch.Tensor, step_u: torch.Tensor,
                               step_decay: torch.Tensor, step_inputs: torch.Tensor) -> torch.Tensor:
    """One gated-DeltaNet layer over a tree of T tokens, from its input projections to its outputs.
    inputs [B, T, C] (the q, k, v channels, C = 2 Hk dk + H dv), write, decay_input [B, T, H] (the
    b and a rows); conv [B, K - 1, C], the committed conv inputs, and conv_weight [C, 1, K];
    A_log, dt_bias [H]; windows [T, K] (each node's conv inputs, indices into conv then inputs:
    models/hybrid.conv_windows); visible [T, T]; state [B, H, dk, dv] fp32, read only.
    Leaves what the commit needs in rows [0, T) of the step buffers: the tokens' factors k, u and G
    in step_k [B, S, H, dk], step_u [B, S, H, dv], step_decay [B, S, H], and their inputs in
    step_inputs [B, S, C]. Returns the outputs [B, T, H, dv] in the inputs' dtype."""
    t = inputs.shape[1]
    q, k, v, g, beta = gated_delta_gates(inputs, write, decay_input, conv, conv_weight, A_log, dt_bias, windows,
                                         *state.shape[1:])
    out, u, decay = gated_delta_tree_reference(q, k, v, g, beta, state, visible)
    step_k[:, :t], step_u[:, :t], step_decay[:, :t], step_inputs[:, :t] = k, u, decay, inputs
    return out.to(inputs.dtype)


def gated_delta_gates(inputs: torch.Tensor, write: torch.Tensor, decay_input: torch.Tensor, conv: torch.Tensor,
                      conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, windows: torch.Tensor,
                      h: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    """The recurrence's per-token inputs from a step's projections (arguments as in
    gated_delta_step_reference; h value heads of dims dk, dv): q, k [B, T, H, dk] (k unit-norm, q
    scaled), v [B, T, H, dv], log-decays g and write strengths beta [B, T, H], all fp32."""
    b, t, c = inputs.shape
    hk = (c - h * dv) // (2 * dk)
    taps = torch.cat([conv, inputs], dim=1)[:, windows]  # [B, T, K, C]
    weight = conv_weight[:, 0].T.float()  # [K, C]
    mixed = F.silu((taps.float() * weight).sum(2)).to(inputs.dtype)  # [B, T, C]
    q, k, v = mixed.split([hk * dk, hk * dk, h * dv], dim=-1)
    q = l2norm(q.reshape(b, t, hk, dk).float()).repeat_interleave(h // hk, dim=2) / math.sqrt(dk)
    k = l2norm(k.reshape(b, t, hk, dk).float()).repeat_interleave(h // hk, dim=2)  # [B, T, H, dk]
    beta = write.sigmoid().float()  # [B, T, H]
    g = -A_log.float().exp() * F.softplus(decay_input.float() + dt_bias.float())  # [B, T, H]: log-decay
    return q, k, v.reshape(b, t, h, dv).float(), g, beta


def gated_delta_commit_reference(state: torch.Tensor, conv: torch.Tensor, step_k: torch.Tensor,
                                 step_u: torch.Tensor, step_decay: torch.Tensor, step_inputs: torch.Tensor,
                                 path: torch.Tensor) -> None:
    """Advance, in place, every layer's state [L, B, H, dk, dv] and conv window [L, B, K - 1, C] to
    the last node of `path` ([P] long: nodes of the last step, root first, -1 padded; all -1: left
    as they are), from the
    step's factors (step_k [L, B, S, H, dk], step_u [L, B, S, H, dv], step_decay [L, B, S, H]) and
    conv inputs step_inputs [L, B, S, C]."""
    _fold_state(state, step_k, step_u, step_decay, path)
    # the conv window ends with the path's inputs: the last K - 1 of (committed window, path)
    kept = conv.shape[2]
    window = torch.cat([conv, step_inputs.index_select(2, path.clamp(min=0))], dim=2)
    conv.copy_(window.index_select(2, (path >= 0).sum() + torch.arange(kept, device=path.device)))


def _fold_state(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, path_decay: torch.Tensor,
                path: torch.Tensor) -> None:
    """Advance state [..., H, dk, dv] in place to the last node of `path` from the step's factors
    k [..., T, H, dk], u [..., T, H, dv] and G [..., T, H] (leading dimensions: layers, batch)."""
    valid = path >= 0
    nodes = path.clamp(min=0)
    last = nodes.gather(0, (valid.sum().reshape(1) - 1).clamp(min=0))  # [1]
    decay = path_decay.index_select(-2, nodes)  # [..., P, H]
    last_decay = torch.where(valid.any(), path_decay.index_select(-2, last), 0.0)  # [..., 1, H] (none: no decay)
    weight = torch.where(valid[:, None], (last_decay - decay).exp(), 0.0)  # [..., P, H]
    written = torch.einsum("...ph,...phk,...phv->...hkv", weight, k.index_select(-3, nodes), u.index_select(-3, nodes))
    state.mul_(last_decay.exp()[..., 0, :, None, None]).add_(written)
