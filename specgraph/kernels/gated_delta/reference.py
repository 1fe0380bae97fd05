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
"""

from __future__ import annotations

import math

import torch


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


def gated_delta_commit_reference(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, path_decay: torch.Tensor,
                                 path: torch.Tensor) -> None:
    """Advance state [..., H, dk, dv] in place to the last node of `path` ([P] long: nodes of the
    step, root first, -1 padded) from the step's factors k [..., T, H, dk], u [..., T, H, dv] and
    G [..., T, H] (leading dimensions: layers, batch)."""
    valid = path >= 0
    nodes = path.clamp(min=0)
    last = nodes.gather(0, valid.sum().reshape(1) - 1)  # [1]
    decay = path_decay.index_select(-2, nodes)  # [..., P, H]
    last_decay = path_decay.index_select(-2, last)  # [..., 1, H]
    weight = torch.where(valid[:, None], (last_decay - decay).exp(), 0.0)  # [..., P, H]
    written = torch.einsum("...ph,...phk,...phv->...hkv", weight, k.index_select(-3, nodes), u.index_select(-3, nodes))
    state.mul_(last_decay.exp()[..., 0, :, None, None]).add_(written)
