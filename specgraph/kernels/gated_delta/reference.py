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
    state [B, H, dk, dv] fp32, each tree's state before the step; visible [B, T, T] bool: node j is
    node i or one of its ancestors (parents come before children).
    Returns outputs [B, T, H, dv], factors u [B, T, H, dv] and path log-decays G [B, T, H]."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
    t = visible.shape[1]
    visible = visible[:, None]  # [B, 1, T, T]
    path_decay = (visible.to(g.dtype) @ g[..., None])[..., 0]  # [B, H, T]: G_i = sum of g_j over i's path
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
                               state: torch.Tensor, rows: torch.Tensor, step_k: torch.Tensor, step_u: torch.Tensor,
                               step_decay: torch.Tensor, step_inputs: torch.Tensor) -> torch.Tensor:
    """One gated-DeltaNet layer over B trees of up to T tokens each (one per request: a segment of a
    packed forward, padded), from its input projections to its outputs. inputs [B, T, C] (the q, k,
    v channels, C = 2 Hk dk + H dv), write, decay_input [B, T, H] (the b and a rows); conv [N, K -
    1, C], the committed conv inputs of the N request slots, and conv_weight [C, 1, K]; A_log,
    dt_bias [H]; windows [B, T, K] (each node's conv inputs, indices into its request's conv then
    inputs: models/hybrid.conv_windows); visible [B, T, T]; state [N, H, dk, dv] fp32, read only;
    rows [B]: each tree's request slot in conv and state. Leaves what the commit needs in rows
    [0, T) of the step buffers: the tokens' factors k, u and G in step_k [B', S, H, dk], step_u [B',
    S, H, dv], step_decay [B', S, H], and their inputs in step_inputs [B', S, C] (B' >= B: tree b in
    row b). Returns the outputs [B, T, H, dv] in the inputs' dtype."""
    b, t = inputs.shape[:2]
    q, k, v, g, beta = gated_delta_gates(inputs, write, decay_input, conv.index_select(0, rows), conv_weight, A_log,
                                         dt_bias, windows, *state.shape[1:])
    out, u, decay = gated_delta_tree_reference(q, k, v, g, beta, state.index_select(0, rows), visible)
    step_k[:b, :t], step_u[:b, :t], step_decay[:b, :t], step_inputs[:b, :t] = k, u, decay, inputs
    return out.to(inputs.dtype)


def gated_delta_gates(inputs: torch.Tensor, write: torch.Tensor, decay_input: torch.Tensor, conv: torch.Tensor,
                      conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, windows: torch.Tensor,
                      h: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    """The recurrence's per-token inputs from a step's projections (arguments as in
    gated_delta_step_reference, with conv [B, K - 1, C] each tree's own; h value heads of dims dk,
    dv): q, k [B, T, H, dk] (k unit-norm, q scaled), v [B, T, H, dv], log-decays g and write
    strengths beta [B, T, H], all fp32."""
    b, t, c = inputs.shape
    hk = (c - h * dv) // (2 * dk)
    taps = torch.cat([conv, inputs], dim=1)  # [B, K - 1 + T, C]
    taps = taps.gather(1, windows.reshape(b, -1, 1).expand(-1, -1, c)).view(b, t, -1, c)  # [B, T, K, C]
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
                                 paths: torch.Tensor, rows: torch.Tensor) -> None:
    """Advance, in place, every layer's state [L, N, H, dk, dv] and conv window [L, N, K - 1, C] of
    request slot rows[b] to the last node of paths[b] (paths [B, P] long: nodes of tree b of the
    last step, root first, -1 padded; all -1: left as they are), from the step's factors (step_k
    [L, B', S, H, dk], step_u [L, B', S, H, dv], step_decay [L, B', S, H]: tree b in row b) and conv
    inputs step_inputs [L, B', S, C]."""
    b = paths.shape[0]
    nodes = paths.clamp(min=0)  # [B, P]
    batch = torch.arange(b, device=paths.device)[:, None]
    valid = paths >= 0
    count = valid.sum(1)  # [B]
    last = nodes.gather(1, (count - 1).clamp(min=0)[:, None])  # [B, 1]
    decay = step_decay[:, batch, nodes]  # [L, B, P, H]
    last_decay = torch.where(count[:, None, None] > 0, step_decay[:, batch, last], 0.0)  # [L, B, 1, H] (none: no decay)
    weight = torch.where(valid[..., None], (last_decay - decay).exp(), 0.0)  # [L, B, P, H]
    written = torch.einsum("lbph,lbphk,lbphv->lbhkv", weight, step_k[:, batch, nodes], step_u[:, batch, nodes])
    state.index_copy_(1, rows, state.index_select(1, rows) * last_decay.exp()[:, :, 0, :, None, None] + written)
    # the conv window ends with the path's inputs: the last K - 1 of (committed window, path)
    kept = conv.shape[2]
    window = torch.cat([conv.index_select(1, rows), step_inputs[:, batch, nodes]], dim=2)  # [L, B, K - 1 + P, C]
    index = count[:, None] + torch.arange(kept, device=paths.device)  # [B, K - 1]
    conv.index_copy_(1, rows, window.gather(2, index[None, :, :, None].expand(window.shape[0], -1, -1, window.shape[3])))
