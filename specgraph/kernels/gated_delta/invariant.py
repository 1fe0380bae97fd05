"""Row-invariant gated-DeltaNet step and commit: each node's output, and the state a commit
leaves, have the bits of one-token steps taken along the node's path.

The closed form (triton.py) gives every node its output from the one committed state with its
path's decays summed: exact in real arithmetic, but not the rounding of one-token steps, which
decay and write the state token by token. Here the step walks each tree node by node, parents
first, each program (tree, value head, value tile) holding its slice of the state on chip. Node
i continues its parent's state S — still on chip when the parent is node i - 1, else read back
from where the parent left it (the committed state of the tree's request slot for a root) — with
the recurrence as it reads:
    u_i = beta_i (v_i - e^{g_i} S^T k_i),   S_i = e^{g_i} S + k_i u_i^T (`_advance`),   o_i = S_i^T q_i
The commit re-runs `_advance` along the accepted path from the stored k, u and g, leaving the
path's last S_i bit for bit. A one-token step (autoregressive decoding) is one kernel, `_decode`:
the arithmetic of `_gates` and `_walk` at T = 1 in the same shapes, so decoding and every tree
agree. A program reads nothing of the other trees of the batch and the same arithmetic wherever
its tree's row and slot are, and a padding node (visible row all False) is walked as a root after
the tree's nodes: a node's bits are also those it has stepped alone. The cost: a step's nodes
are dependent updates (a prompt chunk of 128 tokens is 128 of them, and a short tree beside a
long one walks the long one's padding), and a node whose children do not follow it stores its
state slice.

step_decay holds each node's own log-decay g, not the closed form's path sums G: the step and
the commit come as a pair (kernels.ROW_INVARIANT).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specgraph.kernels.gated_delta.triton import (_beta_decay, _conv_silu, _keep_inputs, _qk, ROW_BLOCK, check_commit,
                                                  fold_conv, gates, key_heads, step_outputs, value_tile)
from specgraph.kernels.pdl import launch


@triton.jit
def _advance(s, g, k, u):
    """S [BK, BV] <- e^g S + k u^T, k [BK], u [BV]: one fma per element, in the step and in the commit."""
    return tl.fma(s, tl.exp(g), k[:, None] * u[None, :])


@triton.jit
def _node(s, q, k, v, beta, g):
    """One node's recurrence from its parent's state slice s [BK, BV] (q, k [BK], v [BV]): its state,
    u [BV] and output [BV] fp32 — the one arithmetic of _walk's nodes and _decode's token."""
    u = beta * (v - tl.exp(g) * tl.sum(s * k[:, None], axis=0))
    s = _advance(s, g, k, u)
    return s, u, tl.sum(s * q[:, None], axis=0)


@triton.jit(do_not_specialize=["T"])
def _walk(q_in, v_in, beta_in, visible, state, requests, states, out, step_k, step_u, step_decay, T, H, HK, s_sk_b,
          s_sk_t, s_su_b, s_su_t, s_sd_b, s_sd_t, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
          BV: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
    """One program per (tree, value head, value tile of BV columns), nodes in order (see the module doc)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b, h, tile = tl.program_id(0) // H, tl.program_id(0) % H, tl.program_id(1)
    keys, vals = tl.arange(0, BK), tile * BV + tl.arange(0, BV)
    kmask, vmask = keys < DK, vals < DV
    tile_mask = kmask[:, None] & vmask[None, :]
    slice_at = keys[:, None] * DV + vals[None, :]  # this tile within a head's [dk, dv] state
    if PDL:
        tl.extra.cuda.gdc_wait()
    committed = state + (tl.load(requests + b) * H + h) * DK * DV + slice_at  # in the tree's request slot
    nodes = tl.arange(0, BT)  # the tree, each program on its own: its nodes' parents, and which to store
    live = nodes < T
    seen = tl.load(visible + (b * T + nodes[:, None]) * T + nodes[None, :], mask=live[:, None] & live[None, :],
                   other=0) != 0
    # [BT]: each node's parent, -1 a root (or padding, which sees nothing: walked as a root)
    parents = tl.max(tl.where(seen & (nodes[None, :] < nodes[:, None]), nodes[None, :], -1), axis=1)
    jumps = (parents >= 0) & (parents != nodes - 1)  # [BT]: children not right after their parent
    kept = tl.max(tl.where((parents[:, None] == nodes[None, :]) & jumps[:, None], 1, 0), axis=0)  # [BT]: their parents
    s = tl.load(committed, mask=tile_mask, other=0.0)  # [BK, BV]
    for i in range(0, T):
        parent = tl.sum(tl.where(nodes == i, parents, 0))  # -1: a root
        source = tl.where(parent < 0, committed, states + ((b * T + parent) * H + h) * DK * DV + slice_at)
        s = tl.where(parent == i - 1, s, tl.load(source, mask=tile_mask & (parent != i - 1), other=0.0))
        at = (b * T + i) * H + h  # row of [B, T, H, ...]
        q = tl.load(q_in + ((b * T + i) * HK + h // (H // HK)) * DK + keys, mask=kmask, other=0.0)  # [B, T, HK, dk]
        k = tl.load(step_k + b * s_sk_b + i * s_sk_t + h * DK + keys, mask=kmask, other=0.0)
        v = tl.load(v_in + at * DV + vals, mask=vmask, other=0.0).to(tl.float32)
        beta, g = tl.load(beta_in + at), tl.load(step_decay + b * s_sd_b + i * s_sd_t + h)
        s, u, o = _node(s, q, k, v, beta, g)
        tl.store(step_u + b * s_su_b + i * s_su_t + h * DV + vals, u, mask=vmask)
        tl.store(out + at * DV + vals, o.to(out.dtype.element_ty), mask=vmask)
        keep = tl.sum(tl.where(nodes == i, kept, 0)) != 0
        tl.store(states + ((b * T + i) * H + h) * DK * DV + slice_at, s, mask=tile_mask & keep)
        tl.debug_barrier()  # a stored state slice is visible to every thread before a later node reads it


@triton.jit
def _decode(inputs, write, decay_input, conv, conv_w, a_log, dt_bias, windows, state, requests, out, step_k, step_u,
            step_decay, step_inputs, H, HK, scale, s_in_b, s_w_b, s_a_b, s_conv_b, s_conv_t, s_sk_b, s_su_b, s_sd_b,
            s_si_b, K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            RB: tl.constexpr, PDL: tl.constexpr):
    """A one-token step in one kernel, one program per (tree, value head, value tile of BV columns):
    _gates' q, k, v (this tile's columns), beta and g of the token, in _gates' shapes (a block of
    RB rows, one live), then _walk's node — the same arithmetic in the same shapes as _gates and
    _walk at T = 1, so the same bits, with no scratch between them and one launch fewer."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b, h, tile = tl.program_id(0) // H, tl.program_id(0) % H, tl.program_id(1)
    group = H // HK  # value heads per key head
    keys, vals, rows = tl.arange(0, BK), tile * BV + tl.arange(0, BV), tl.arange(0, RB)
    kmask, vmask, live = keys < DK, vals < DV, rows < 1
    tile_mask = kmask[:, None] & vmask[None, :]
    g_scale, g_bias = -tl.exp(tl.load(a_log + h).to(tl.float32)), tl.load(dt_bias + h).to(tl.float32)
    p_in = inputs + b * s_in_b  # the tree's token [C]
    if PDL:
        tl.extra.cuda.gdc_wait()
    slot = tl.load(requests + b)  # the tree's request slot
    p_conv = conv + slot * s_conv_b
    s = tl.load(state + (slot * H + h) * DK * DV + keys[:, None] * DV + vals[None, :], mask=tile_mask, other=0.0)
    q, k = _qk(p_in, p_conv, conv_w, windows, h // group, 0, s_conv_t, rows, live, scale, HK, K, DK, RB, BK,
               True)  # [RB, BK]
    v = _conv_silu(p_in, p_conv, conv_w, windows, 0, s_conv_t, rows, live, 2 * HK * DK + h * DV + vals, vmask, K, RB,
                   BV, True)  # [RB, BV]
    beta, g = _beta_decay(write, decay_input, b, h, s_w_b, 0, s_a_b, 0, rows, live, g_scale, g_bias,
                          inputs.dtype.element_ty)  # [RB]
    first = rows == 0  # the token's row: a sum with zeros, exact
    q, k = tl.sum(tl.where(first[:, None], q, 0.0), axis=0), tl.sum(tl.where(first[:, None], k, 0.0), axis=0)  # [BK]
    v = tl.sum(tl.where(first[:, None], v, 0.0), axis=0)  # [BV]
    beta, g = tl.sum(tl.where(first, beta, 0.0)), tl.sum(tl.where(first, g, 0.0))
    _, u, o = _node(s, q, k, v, beta, g)
    tl.store(step_u + b * s_su_b + h * DV + vals, u, mask=vmask)
    tl.store(out + (b * H + h) * DV + vals, o.to(out.dtype.element_ty), mask=vmask)
    _keep_inputs(inputs, step_inputs, b, h, h // group, s_in_b, 0, s_si_b, 0, rows, live, keys, kmask,
                 vals, vmask, (tile == 0) & (h % group == 0), HK, DK, DV)
    if tile == 0:
        tl.store(step_k + b * s_sk_b + h * DK + keys, k, mask=kmask)
        tl.store(step_decay + b * s_sd_b + h, g)


@torch.library.custom_op("specgraph::gated_delta_step_invariant",
                         mutates_args=("step_k", "step_u", "step_decay", "step_inputs"))
def gated_delta_step_invariant(inputs: torch.Tensor, write: torch.Tensor, decay_input: torch.Tensor,
                               conv: torch.Tensor, conv_weight: torch.Tensor, A_log: torch.Tensor,
                               dt_bias: torch.Tensor, windows: torch.Tensor, visible: torch.Tensor,
                               state: torch.Tensor, rows: torch.Tensor, step_k: torch.Tensor, step_u: torch.Tensor,
                               step_decay: torch.Tensor, step_inputs: torch.Tensor) -> torch.Tensor:
    """Signature and outputs as gated_delta_step_reference; step_decay gets each node's g (see the module doc)."""
    (b, t, _), (h, dk, dv) = inputs.shape, state.shape[1:]
    assert step_u.stride(2) == dv and step_u.stride(3) == 1, "step_u rows [H, dv] contiguous"
    out, bv, bk = inputs.new_empty(b, t, h, dv), value_tile(dv), max(16, triton.next_power_of_2(dk))
    rows = rows.contiguous()
    if t == 1:
        hk = key_heads(inputs, write, decay_input, conv, conv_weight, windows, state, rows, step_k, step_decay,
                       step_inputs)
        _decode[(b * h, triton.cdiv(dv, bv))](inputs, write, decay_input, conv, conv_weight.contiguous(), A_log, dt_bias,
                                              windows, state.contiguous(), rows, out, step_k, step_u, step_decay,
                                              step_inputs, h, hk, dk ** -0.5, inputs.stride(0), write.stride(0),
                                              decay_input.stride(0), conv.stride(0), conv.stride(1), step_k.stride(0),
                                              step_u.stride(0), step_decay.stride(0), step_inputs.stride(0),
                                              K=conv_weight.shape[-1], DK=dk, DV=dv, BK=bk, BV=bv, RB=ROW_BLOCK,
                                              **launch(inputs.device))
        return out
    visible = visible.contiguous()
    q, v, beta = gates(inputs, write, decay_input, conv, conv_weight, A_log, dt_bias, windows, visible, state, rows,
                       step_k, step_decay, step_inputs, path=False)
    states = torch.empty(b, t, h, dk, dv, dtype=torch.float32, device=inputs.device)  # the stored nodes' S_i
    _walk[(b * h, triton.cdiv(dv, bv))](q, v, beta, visible, state.contiguous(), rows, states, out, step_k, step_u,
                                        step_decay, t, h, q.shape[2], step_k.stride(0), step_k.stride(1),
                                        step_u.stride(0), step_u.stride(1), step_decay.stride(0),
                                        step_decay.stride(1), DK=dk, DV=dv, BK=bk, BV=bv,
                                        BT=max(16, triton.next_power_of_2(t)), **launch(inputs.device))
    return out


gated_delta_step_invariant.register_fake(step_outputs)


@triton.jit(do_not_specialize=["P"])
def _fold_path(state, step_k, step_u, step_decay, paths, requests, B, N, SB, P, H, S, DK: tl.constexpr,
               DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One program per (layer * B + tree b, value head, value tile): `_advance` along tree b's path,
    from step row b, in the state slice of its request slot."""
    pid = tl.program_id(0).to(tl.int64)  # (offsets past 2^31 elements: the state of many layers and slots)
    lb, h = pid // H, pid % H
    layer, b = lb // B, lb % B
    keys, vals = tl.arange(0, BK), tl.program_id(1) * BV + tl.arange(0, BV)
    kmask, vmask = keys < DK, vals < DV
    tile_mask = kmask[:, None] & vmask[None, :]
    ptrs = state + (((layer * N + tl.load(requests + b)) * H + h) * DK + keys[:, None]) * DV + vals[None, :]
    s = tl.load(ptrs, mask=tile_mask, other=0.0)
    for p in range(0, P):
        node = tl.load(paths + b * P + p)
        on = node >= 0  # (-1 pads the path's end)
        row = ((layer * SB + b) * S + tl.maximum(node, 0)) * H + h
        k = tl.load(step_k + row * DK + keys, mask=kmask & on, other=0.0)
        u = tl.load(step_u + row * DV + vals, mask=vmask & on, other=0.0)
        s = tl.where(on, _advance(s, tl.load(step_decay + row), k, u), s)
    tl.store(ptrs, s, mask=tile_mask)


@torch.library.custom_op("specgraph::gated_delta_commit_invariant", mutates_args=("state", "conv"))
def gated_delta_commit_invariant(state: torch.Tensor, conv: torch.Tensor, step_k: torch.Tensor, step_u: torch.Tensor,
                                 step_decay: torch.Tensor, step_inputs: torch.Tensor, paths: torch.Tensor,
                                 rows: torch.Tensor) -> None:
    """Signature and effect as gated_delta_commit_reference, from gated_delta_step_invariant's factors (contiguous)."""
    check_commit(state, conv, step_k, step_u, step_decay, step_inputs, paths, rows)
    (layers, n, h, dk, dv), (sb, s), (b, p) = state.shape, step_k.shape[1:3], paths.shape
    bv = value_tile(dv)
    _fold_path[(layers * b * h, triton.cdiv(dv, bv))](state, step_k, step_u, step_decay, paths, rows, b, n, sb, p, h, s,
                                                        DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=bv)
    fold_conv(conv, step_inputs, paths, rows)
