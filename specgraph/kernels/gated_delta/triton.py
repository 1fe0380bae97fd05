"""Triton gated-DeltaNet tree step and commit (Bole's closed form, fused).

A step is B trees (one per request of a packed forward) padded to T nodes, tree b's committed
state and conv window in request slot rows[b] of the pool: every program works on one tree and
reads its slot once (one scalar load), so the trees of a batch share nothing but the launch.
Padding nodes see nothing, not even themselves (their visible rows are all False): they get
G = 0 and no node pairs, so finite, unused results read from the committed state (their windows
are in range like every node's: models/hybrid.conv_windows).

`gated_delta_step`: three kernels, each over a tree in blocks of 16 nodes (parents first). The
first, one program per (tree, value head, block), gives each node its inputs: the short
convolution over its ancestor window, silu, the q/k L2 norms, the gates and the path log-decay G.
The second, one program per (tree, value head, block r), forms the node-pair matrices of the block's
rows — A (the ancestor-masked system (I + A) U = R) and P (the outputs' weights on U) — and
inverts the block's diagonal (I + A_rr) by exact block formulas. The third, one program per
(tree, value head, value tile of BV columns), keeps the committed state's [dk, BV] slice on chip
and solves block by block (matrix products against the blocks before, then the diagonal block's
inverse), giving every node its output from the one state. No per-node state is formed. A
one-token step (autoregressive decoding) is the same kernels with T = 1.

`gated_delta_commit`: one program per (layer, tree, value head, value tile) folds the tree's
accepted path's factors into its slot's state slice; one per (layer, tree, channel block) shifts
the slot's conv window. Same signatures and results as the references (fp32 arithmetic,
activations rounded where the reference rounds them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specgraph.kernels.pdl import launch

IEEE = tl.constexpr("ieee")  # fp32 dots in full precision (no TF32): they match the reference's


@triton.jit
def _softplus(x):
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _conv_silu(inputs, conv, conv_w, windows, s_in_t, s_conv_t, rows, live, channels, cmask,
               K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, ONE: tl.constexpr):
    """silu of each node's convolution over its window, for `channels` [BC] -> [BT, BC] fp32, rounded
    to the activations' dtype like the reference; inputs [T, C], conv [K - 1, C] and windows [T, K]
    are the tree's own (its slot's conv window). ONE: a one-token step, whose window is known (the
    committed inputs, then the token: windows unread, one load fewer before the arithmetic)."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        if ONE:
            idx = tl.full([BT], j, tl.int32)
        else:
            idx = tl.load(windows + rows * K + j, mask=live, other=K - 1)  # [BT]: < K - 1 in the committed window
        old, new = live & (idx < K - 1), live & (idx >= K - 1)
        x = tl.load(conv + idx[:, None] * s_conv_t + channels[None, :],
                    mask=old[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        x += tl.load(inputs + (idx - (K - 1))[:, None] * s_in_t + channels[None, :],
                     mask=new[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(conv_w + channels * K + j, mask=cmask, other=0.0).to(tl.float32)  # [BC]
        acc += x * w[None, :]
    return (acc * tl.sigmoid(acc)).to(inputs.dtype.element_ty).to(tl.float32)


@triton.jit
def _qk(inputs, conv, conv_w, windows, hk, s_in_t, s_conv_t, rows, live, scale, HK,
        K: tl.constexpr, DK: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr, ONE: tl.constexpr):
    """Rows' q and k [RB, BK] of key head hk (the tree's inputs, conv and windows: _conv_silu):
    convolved, silu, L2-normalised, q scaled."""
    keys = tl.arange(0, BK)
    kmask = keys < DK
    q = _conv_silu(inputs, conv, conv_w, windows, s_in_t, s_conv_t, rows, live, hk * DK + keys, kmask, K, RB, BK, ONE)
    k = _conv_silu(inputs, conv, conv_w, windows, s_in_t, s_conv_t, rows, live, (HK + hk) * DK + keys, kmask, K, RB,
                   BK, ONE)
    return q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None] * scale, k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]


@triton.jit
def _beta_decay(write, decay_input, b, h, s_w_b, s_w_t, s_a_b, s_a_t, rows, live, g_scale, g_bias, dtype):
    """Rows' write strength beta (rounded to the activations' dtype, like the reference) and own log-decay g [RB]."""
    beta = tl.sigmoid(tl.load(write + b * s_w_b + rows * s_w_t + h, mask=live, other=0.0).to(tl.float32))
    a = tl.load(decay_input + b * s_a_b + rows * s_a_t + h, mask=live, other=0.0).to(tl.float32)
    return beta.to(dtype).to(tl.float32), g_scale * _softplus(a + g_bias)


@triton.jit(do_not_specialize=["T"])  # (T = 1 compiles no other kernel: kernels/gated_delta/invariant.py)
def _gates(inputs, write, decay_input, conv, conv_w, a_log, dt_bias, windows, visible, requests, q_out, v_out,
           beta_out, step_k, step_decay, step_inputs, T, H, HK, scale, s_in_b, s_in_t, s_w_b, s_w_t, s_a_b, s_a_t,
           s_conv_b, s_conv_t, s_sk_b, s_sk_t, s_sd_b, s_sd_t, s_si_b, s_si_t, K: tl.constexpr, DK: tl.constexpr,
           DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BDV: tl.constexpr, RB: tl.constexpr,
           PATH: tl.constexpr, PDL: tl.constexpr):
    """One program per (tree, value head, block of RB nodes): each node's q, k (its key head's),
    beta, and into step_decay its path log-decay G (PATH: the closed form) or its own log-decay g
    and its v (not PATH: the walk; `visible` unused); copies the nodes' inputs to step_inputs
    (_keep_inputs)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b, h = tl.program_id(0) // H, tl.program_id(0) % H
    hk = h // (H // HK)
    nodes, keys, vals = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BDV)
    kmask, vmask = keys < DK, vals < DV
    g_scale, g_bias = -tl.exp(tl.load(a_log + h).to(tl.float32)), tl.load(dt_bias + h).to(tl.float32)
    p_in, p_win = inputs + b * s_in_b, windows + b * T * K  # the tree's inputs [T, C] and windows [T, K]
    if PDL:
        tl.extra.cuda.gdc_wait()
    p_conv = conv + tl.load(requests + b) * s_conv_b  # its request slot's committed window [K - 1, C]
    rows = tl.program_id(1) * RB + tl.arange(0, RB)  # this program's block of nodes
    live = rows < T
    q, k = _qk(p_in, p_conv, conv_w, p_win, hk, s_in_t, s_conv_t, rows, live, scale, HK, K, DK, RB, BK,
               False)  # [RB, BK]
    beta, decay = _beta_decay(write, decay_input, b, h, s_w_b, s_w_t, s_a_b, s_a_t, rows, live, g_scale, g_bias,
                              inputs.dtype.element_ty)  # [RB]: beta, g
    if PATH:
        a = tl.load(decay_input + b * s_a_b + nodes * s_a_t + h, mask=nodes < T, other=0.0).to(tl.float32)
        g = tl.where(nodes < T, g_scale * _softplus(a + g_bias), 0.0)  # [BT]: every node's log-decay
        seen = tl.load(visible + (b * T + rows[:, None]) * T + nodes[None, :],
                       mask=live[:, None] & (nodes < T)[None, :], other=0) != 0  # [RB, BT]: ancestors or self
        decay = tl.sum(tl.where(seen, g[None, :], 0.0), axis=1)  # [RB]: G
    at = (b * T + rows[:, None]) * H + h  # row of [B, T, H, ...] scratch
    tl.store(q_out + ((b * T + rows[:, None]) * HK + hk) * DK + keys[None, :], q,  # its key head's: [B, T, HK, dk]
             mask=live[:, None] & kmask[None, :] & (h % (H // HK) == 0))
    if not PATH:  # the walk's v (the closed form's solve convolves its own value tile)
        v = _conv_silu(p_in, p_conv, conv_w, p_win, s_in_t, s_conv_t, rows, live, 2 * HK * DK + h * DV + vals, vmask,
                       K, RB, BDV, False)  # [RB, BDV]
        tl.store(v_out + at * DV + vals[None, :], v.to(v_out.dtype.element_ty),  # (exact: rounded there already)
                 mask=live[:, None] & vmask[None, :])
    tl.store(beta_out + (b * T + rows) * H + h, beta, mask=live)
    tl.store(step_k + b * s_sk_b + rows[:, None] * s_sk_t + h * DK + keys[None, :], k,
             mask=live[:, None] & kmask[None, :])
    tl.store(step_decay + b * s_sd_b + rows * s_sd_t + h, decay, mask=live)
    _keep_inputs(inputs, step_inputs, b, h, hk, s_in_b, s_in_t, s_si_b, s_si_t, rows, live, keys, kmask,
                 vals, vmask, h % (H // HK) == 0, HK, DK, DV)


@triton.jit
def _keep_inputs(inputs, step_inputs, b, h, hk, s_in_b, s_in_t, s_si_b, s_si_t, rows, live, keys, kmask, vals, vmask,
                 QK, HK, DK: tl.constexpr, DV: tl.constexpr):
    """Rows' inputs copied to step_inputs for the commit: value head h's `vals` channels, and with QK
    its key head's q and k channels (QK true in one program of those reading key head hk)."""
    rows_in, rows_out = b * s_in_b + rows[:, None] * s_in_t, b * s_si_b + rows[:, None] * s_si_t
    v_channels = 2 * HK * DK + h * DV + vals
    tl.store(step_inputs + rows_out + v_channels[None, :],
             tl.load(inputs + rows_in + v_channels[None, :], mask=live[:, None] & vmask[None, :]),
             mask=live[:, None] & vmask[None, :])
    if QK:
        for part in tl.static_range(2):
            qk_channels = (part * HK + hk) * DK + keys
            tl.store(step_inputs + rows_out + qk_channels[None, :],
                     tl.load(inputs + rows_in + qk_channels[None, :], mask=live[:, None] & kmask[None, :]),
                     mask=live[:, None] & kmask[None, :])


@triton.jit
def _unit_lower_inverse(A, RB: tl.constexpr):
    """(I + A)^-1 [RB, RB] for A strictly lower-triangular, RB a power of two: the inverses X of the
    diagonal blocks of 1, 2, 4, ... rows, each level's pair of blocks [[L1, 0], [E, L2]] from its
    halves' by the exact block formula X - X E X (no power series: stable like substitution, in
    log2(RB) pairs of matrix products instead of RB - 1 dependent row updates)."""
    idx = tl.arange(0, RB)
    x = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    for level in tl.static_range(RB.bit_length() - 1):  # blocks of 2^level rows paired
        pair = (idx[:, None] >> (level + 1)) == (idx[None, :] >> (level + 1))
        e = tl.where(pair & ((idx[:, None] >> level) != (idx[None, :] >> level)), A, 0.0)  # pairs' lower-left blocks
        x -= tl.dot(x, tl.dot(e, x, input_precision=IEEE), input_precision=IEEE)
    return x


@triton.jit
def _pairs(q_in, beta_in, visible, step_k, step_decay, pairs, pair_d, T, H, HK, s_sk_b, s_sk_t, s_sd_b, s_sd_t,
           DK: tl.constexpr, BK: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr):
    """One program per (tree, value head, block r of RB nodes): the block's rows of the node-pair
    matrices, for every earlier block c and its own: P_rc = e^(G_r - G_c) q_r k_c^T (ancestors and
    self; lower-triangular) into the lower triangle of `pairs` [B, H, T, T] and
    A_rc = beta_r e^(G_r - G_c) k_r k_c^T (strict ancestors), transposed, into its strict upper
    triangle — and the inverse (I + A_rr)^-1 of its diagonal block into pair_d [B, H, T, RB]."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b, h, r0 = tl.program_id(0) // H, tl.program_id(0) % H, tl.program_id(1) * RB
    keys, idx = tl.arange(0, BK), tl.arange(0, RB)
    kmask = keys < DK
    rows = r0 + idx
    live = rows < T
    if PDL:
        tl.extra.cuda.gdc_wait()
    at = (b * T + rows) * H + h
    q = tl.load(q_in + ((b * T + rows[:, None]) * HK + h // (H // HK)) * DK + keys[None, :],
                mask=live[:, None] & kmask[None, :], other=0.0)  # [RB, BK]
    k = tl.load(step_k + b * s_sk_b + rows[:, None] * s_sk_t + h * DK + keys[None, :],
                mask=live[:, None] & kmask[None, :], other=0.0)
    beta = tl.load(beta_in + at, mask=live, other=0.0)
    path = tl.load(step_decay + b * s_sd_b + rows * s_sd_t + h, mask=live, other=0.0)  # [RB]: G
    head = pairs + (b * H + h) * T * T  # this head's [T, T]
    for c0 in range(0, r0 + RB, RB):  # the earlier blocks, then this one
        cols = c0 + idx
        on = live[:, None] & (cols < T)[None, :]
        k_c = tl.load(step_k + b * s_sk_b + cols[:, None] * s_sk_t + h * DK + keys[None, :],
                      mask=(cols < T)[:, None] & kmask[None, :], other=0.0)
        g_c = tl.load(step_decay + b * s_sd_b + cols * s_sd_t + h, mask=cols < T, other=0.0)
        seen = tl.load(visible + (b * T + rows[:, None]) * T + cols[None, :], mask=on, other=0) != 0  # [RB, RB]
        decay = tl.where(seen, tl.exp(tl.where(seen, path[:, None] - g_c[None, :], 0.0)), 0.0)
        a = tl.where(seen & (rows[:, None] != cols[None, :]),
                     beta[:, None] * decay * tl.dot(k, tl.trans(k_c), input_precision=IEEE), 0.0)  # A_rc
        below = cols[None, :] < rows[:, None]
        tl.store(head + cols[None, :] * T + rows[:, None], a, mask=on & below)  # A^T above the diagonal
        tl.store(head + rows[:, None] * T + cols[None, :], decay * tl.dot(q, tl.trans(k_c), input_precision=IEEE),
                 mask=on & (below | (cols[None, :] == rows[:, None])))  # P on and below it
        if c0 == r0:
            tl.store(pair_d + ((b * H + h) * T + rows[:, None]) * RB + idx[None, :], _unit_lower_inverse(a, RB),
                     mask=live[:, None])


@triton.jit
def _tree(q_in, inputs, conv, conv_w, windows, beta_in, state, requests, out, step_k, step_u, step_decay, pairs,
          pair_d, T, H, HK, s_in_b, s_in_t, s_conv_b, s_conv_t, s_sk_b, s_sk_t, s_su_b, s_su_t, s_sd_b, s_sd_t,
          K: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, RB: tl.constexpr,
          PDL: tl.constexpr):
    """One program per (tree, value head, value tile of BV columns), blocks of RB nodes in order: block r
    solves (I + A_rr) U_r = R_r - sum_c<r A_rc U_c with R_r = beta_r (v_r - e^G_r S^T k_r) (its U_c read
    back from step_u, where this program stored them) and outputs
    o_r = e^G_r S^T q_r + sum_c<=r P_rc U_c, from the state tile S [BK, BV] and _pairs' A, P and
    (I + A_rr)^-1."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    b, h, tile = tl.program_id(0) // H, tl.program_id(0) % H, tl.program_id(1)
    keys, vals, idx = tl.arange(0, BK), tile * BV + tl.arange(0, BV), tl.arange(0, RB)
    kmask, vmask = keys < DK, vals < DV
    p_in, p_win = inputs + b * s_in_b, windows + b * T * K  # the tree's inputs [T, C] and windows [T, K]
    if PDL:
        tl.extra.cuda.gdc_wait()
    slot = tl.load(requests + b)  # the tree's request slot
    p_conv = conv + slot * s_conv_b
    s = tl.load(state + ((slot * H + h) * DK + keys[:, None]) * DV + vals[None, :],
                mask=kmask[:, None] & vmask[None, :], other=0.0)  # [BK, BV]: this tile of the committed state
    head = pairs + (b * H + h) * T * T  # this head's [T, T] (_pairs)
    for r0 in range(0, T, RB):
        rows = r0 + idx
        live = rows < T
        at = (b * T + rows) * H + h
        q = tl.load(q_in + ((b * T + rows[:, None]) * HK + h // (H // HK)) * DK + keys[None, :],
                    mask=live[:, None] & kmask[None, :], other=0.0)
        k = tl.load(step_k + b * s_sk_b + rows[:, None] * s_sk_t + h * DK + keys[None, :],
                    mask=live[:, None] & kmask[None, :], other=0.0)  # [RB, BK]
        v = _conv_silu(p_in, p_conv, conv_w, p_win, s_in_t, s_conv_t, rows, live, 2 * HK * DK + h * DV + vals, vmask,
                       K, RB, BV, False)  # [RB, BV]: _gates' v of this tile
        beta = tl.load(beta_in + at, mask=live, other=0.0)
        start = tl.exp(tl.load(step_decay + b * s_sd_b + rows * s_sd_t + h, mask=live, other=0.0))[:, None]  # e^G
        rhs = beta[:, None] * (v - start * tl.dot(k, s, input_precision=IEEE))  # R_r [RB, BV]
        o = start * tl.dot(q, s, input_precision=IEEE)
        for c0 in range(0, r0, RB):  # earlier blocks, solved
            cols = c0 + idx
            u_c = tl.load(step_u + b * s_su_b + cols[:, None] * s_su_t + h * DV + vals[None, :],
                          mask=vmask[None, :], other=0.0)
            a = tl.load(head + cols[None, :] * T + rows[:, None], mask=live[:, None], other=0.0)  # [RB, RB]: A_rc
            rhs -= tl.dot(a, u_c, input_precision=IEEE)
            o += tl.dot(tl.load(head + rows[:, None] * T + cols[None, :], mask=live[:, None], other=0.0), u_c,
                        input_precision=IEEE)  # P_rc
        inverse = tl.load(pair_d + ((b * H + h) * T + rows[:, None]) * RB + idx[None, :], mask=live[:, None],
                          other=0.0)  # [RB, RB]: (I + A_rr)^-1
        u = tl.dot(inverse, rhs, input_precision=IEEE)
        p = tl.load(head + rows[:, None] * T + rows[None, :], other=0.0,
                    mask=live[:, None] & live[None, :] & (idx[None, :] <= idx[:, None]))  # P_rr
        o += tl.dot(p, u, input_precision=IEEE)
        tile_mask = live[:, None] & vmask[None, :]
        tl.store(step_u + b * s_su_b + rows[:, None] * s_su_t + h * DV + vals[None, :], u, mask=tile_mask)
        tl.store(out + at[:, None] * DV + vals[None, :], o.to(out.dtype.element_ty), mask=tile_mask)
        tl.debug_barrier()  # U_r stored before a later block reads it


ROW_BLOCK = 16  # nodes per block of the solve (the smallest tl.dot)


def value_tile(dv: int) -> int:
    return min(triton.next_power_of_2(dv), 32)


def key_heads(inputs: torch.Tensor, write: torch.Tensor, decay_input: torch.Tensor, conv: torch.Tensor,
              conv_weight: torch.Tensor, windows: torch.Tensor, state: torch.Tensor, rows: torch.Tensor,
              step_k: torch.Tensor, step_decay: torch.Tensor, step_inputs: torch.Tensor) -> int:
    """The step's key head count, once its tensors are checked to be what the kernels take."""
    (b, t, c), (h, dk, dv), kernel = inputs.shape, state.shape[1:], conv_weight.shape[-1]
    assert b <= step_k.shape[0] and t <= step_k.shape[1] and windows.shape == (b, t, kernel), "step shapes disagree"
    assert rows.shape == (b,) and conv.shape[0] == state.shape[0], "a request slot per tree, in conv and state"
    hk = (c - h * dv) // (2 * dk)
    assert c == 2 * hk * dk + h * dv and h % hk == 0 and dv >= 16, "heads or head dims the kernels do not take"
    assert all(x.stride(-1) == 1 for x in (inputs, write, decay_input, conv, step_inputs)), \
        "needs unit-stride last dimensions"
    assert (step_k.stride(2), step_k.stride(3), step_decay.stride(2)) == (dk, 1, 1), "step rows [H, dk], [H] contiguous"
    return hk


def gates(inputs: torch.Tensor, write: torch.Tensor, decay_input: torch.Tensor, conv: torch.Tensor,
          conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, windows: torch.Tensor,
          visible: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, step_k: torch.Tensor,
          step_decay: torch.Tensor, step_inputs: torch.Tensor, path: bool
          ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The _gates kernel (arguments as gated_delta_step's; visible contiguous): writes each node's k
    and log-decay (its path's sum G, or its own g) to step_k and step_decay, its inputs to
    step_inputs, and returns its q per key head [B, T, HK, dk] and beta [B, T, H], fp32, and for the
    walk (not `path`) its v [B, T, H, dv] in the activations' dtype (None for the closed form, whose
    solve convolves its own value tiles)."""
    (b, t, _), (h, dk, dv), kernel = inputs.shape, state.shape[1:], conv_weight.shape[-1]
    assert visible.shape == (b, t, t), "step shapes disagree"
    hk = key_heads(inputs, write, decay_input, conv, conv_weight, windows, state, rows, step_k, step_decay, step_inputs)
    q, beta = (torch.empty(b, t, *d, dtype=torch.float32, device=inputs.device) for d in ((hk, dk), (h,)))
    v = None if path else inputs.new_empty(b, t, h, dv)  # silu's outputs, already rounded to the activations' dtype
    _gates[(b * h, triton.cdiv(t, ROW_BLOCK))](inputs, write, decay_input, conv, conv_weight.contiguous(), A_log,
                     dt_bias, windows.contiguous(), visible, rows.contiguous(), q, v, beta, step_k, step_decay,
                     step_inputs, t, h, hk, dk ** -0.5, inputs.stride(0), inputs.stride(1), write.stride(0), write.stride(1),
                     decay_input.stride(0), decay_input.stride(1), conv.stride(0), conv.stride(1), step_k.stride(0),
                     step_k.stride(1), step_decay.stride(0), step_decay.stride(1), step_inputs.stride(0),
                     step_inputs.stride(1), K=kernel, DK=dk, DV=dv, BT=max(16, triton.next_power_of_2(t)),
                     BK=max(16, triton.next_power_of_2(dk)), BDV=max(16, triton.next_power_of_2(dv)), RB=ROW_BLOCK,
                     PATH=path, **launch(inputs.device))
    return q, v, beta


@torch.library.custom_op("specgraph::gated_delta_step", mutates_args=("step_k", "step_u", "step_decay", "step_inputs"))
def gated_delta_step(inputs: torch.Tensor, write: torch.Tensor, decay_input: torch.Tensor, conv: torch.Tensor,
                     conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, windows: torch.Tensor,
                     visible: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, step_k: torch.Tensor,
                     step_u: torch.Tensor, step_decay: torch.Tensor, step_inputs: torch.Tensor) -> torch.Tensor:
    """Same signature and result as gated_delta_step_reference (last dimensions contiguous; conv
    window, state and step tensors contiguous per slot or step row)."""
    (b, t, _), (h, dk, dv) = inputs.shape, state.shape[1:]
    assert step_u.stride(2) == dv and step_u.stride(3) == 1, "step_u rows [H, dv] contiguous"
    visible, rows = visible.contiguous(), rows.contiguous()
    q, _, beta = gates(inputs, write, decay_input, conv, conv_weight, A_log, dt_bias, windows, visible, state, rows,
                       step_k, step_decay, step_inputs, path=True)
    out, bk, bv = inputs.new_empty(b, t, h, dv), max(16, triton.next_power_of_2(dk)), value_tile(dv)
    pairs = q.new_empty(b, h, t, t)  # [B, H, T, T]: node-pair matrices P and A^T (_pairs)
    pair_d = q.new_empty(b, h, t, ROW_BLOCK)  # the diagonal blocks' inverses, by rows
    strides = (step_k.stride(0), step_k.stride(1), step_decay.stride(0), step_decay.stride(1))
    _pairs[(b * h, triton.cdiv(t, ROW_BLOCK))](q, beta, visible, step_k, step_decay, pairs, pair_d, t, h,
                                               q.shape[2], *strides, DK=dk, BK=bk, RB=ROW_BLOCK, **launch(inputs.device))
    _tree[(b * h, triton.cdiv(dv, bv))](q, inputs, conv, conv_weight.contiguous(), windows.contiguous(), beta,
                                        state.contiguous(), rows, out, step_k, step_u, step_decay, pairs, pair_d, t, h,
                                        q.shape[2], inputs.stride(0), inputs.stride(1), conv.stride(0),
                                        conv.stride(1), step_k.stride(0), step_k.stride(1), step_u.stride(0),
                                        step_u.stride(1), step_decay.stride(0), step_decay.stride(1),
                                        K=conv_weight.shape[-1], DK=dk, DV=dv, BK=bk, BV=bv, RB=ROW_BLOCK,
                                        **launch(inputs.device))
    return out


@gated_delta_step.register_fake
def step_outputs(inputs, write, decay_input, conv, conv_weight, A_log, dt_bias, windows, visible, state, rows, step_k,
                 step_u, step_decay, step_inputs):
    """A gated-DeltaNet step's outputs [B, T, H, dv], unfilled (the fake of every step op)."""
    (b, t, _), (h, _, dv) = inputs.shape, state.shape[1:]
    return inputs.new_empty(b, t, h, dv)


@triton.jit
def _fold_state(state, step_k, step_u, step_decay, paths, requests, B, N, SB, P, H, S, DK: tl.constexpr,
                DV: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One program per (layer * B + tree b, value head, value tile): tree b's path folded from step
    row b into the state slice of its request slot."""
    pid = tl.program_id(0).to(tl.int64)  # (offsets past 2^31 elements: the state of many layers and slots)
    lb, h, tile = pid // H, pid % H, tl.program_id(1)
    layer, b = lb // B, lb % B
    p, keys, vals = tl.arange(0, BP), tl.arange(0, BK), tile * BV + tl.arange(0, BV)
    kmask, vmask = keys < DK, vals < DV
    step_row = layer * SB + b  # of step_* [L, SB, S, ...]
    nodes = tl.load(paths + b * P + p, mask=p < P, other=-1)
    on = nodes >= 0
    node = tl.where(on, nodes, 0)
    count = tl.sum(on.to(tl.int32), axis=0)
    last = tl.sum(tl.where(p == count - 1, node, 0), axis=0)
    g_last = tl.load(step_decay + (step_row * S + last) * H + h, mask=count > 0, other=0.0)  # (an empty path: no decay)
    g = tl.load(step_decay + (step_row * S + node) * H + h, mask=on, other=0.0)
    weight = tl.where(on, tl.exp(g_last - g), 0.0)  # [BP]
    k = tl.load(step_k + ((step_row * S + node[:, None]) * H + h) * DK + keys[None, :],
                mask=on[:, None] & kmask[None, :], other=0.0)  # [BP, BK]
    u = tl.load(step_u + ((step_row * S + node[:, None]) * H + h) * DV + vals[None, :],
                mask=on[:, None] & vmask[None, :], other=0.0)  # [BP, BV]
    ptrs = state + (((layer * N + tl.load(requests + b)) * H + h) * DK + keys[:, None]) * DV + vals[None, :]
    tile_mask = kmask[:, None] & vmask[None, :]
    s = tl.load(ptrs, mask=tile_mask, other=0.0)
    s = s * tl.exp(g_last) + tl.dot(tl.trans(k * weight[:, None]), u, input_precision=IEEE)
    tl.store(ptrs, s, mask=tile_mask)


@triton.jit
def _fold_conv(conv, step_inputs, paths, requests, B, N, SB, P, S, C, KEPT: tl.constexpr, BP: tl.constexpr,
               BR: tl.constexpr, BC: tl.constexpr):
    """One program per (layer * B + tree b, channel block): the conv window of tree b's request slot
    advanced along its path (inputs from step row b)."""
    lb = tl.program_id(0).to(tl.int64)
    layer, b = lb // B, lb % B
    window = conv + (layer * N + tl.load(requests + b)) * KEPT * C  # the slot's [KEPT, C]
    inputs = step_inputs + (layer * SB + b) * S * C  # step row b's [S, C]
    channels = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = channels < C
    p, r = tl.arange(0, BP), tl.arange(0, BR)
    n = tl.sum((tl.load(paths + b * P + p, mask=p < P, other=-1) >= 0).to(tl.int32), axis=0)
    source = n + r  # [BR]: the new window's rows, in (committed window, path)
    old, new = (r < KEPT) & (source < KEPT), (r < KEPT) & (source >= KEPT)
    node = tl.load(paths + b * P + source - KEPT, mask=new, other=0)
    x = tl.load(window + source[:, None] * C + channels[None, :], mask=old[:, None] & cmask[None, :], other=0.0)
    x += tl.load(inputs + node[:, None] * C + channels[None, :], mask=new[:, None] & cmask[None, :], other=0.0)
    tl.debug_barrier()  # every row read before any is overwritten (row r takes row n + r)
    tl.store(window + r[:, None] * C + channels[None, :], x, mask=(r < KEPT)[:, None] & cmask[None, :])


@torch.library.custom_op("specgraph::gated_delta_commit", mutates_args=("state", "conv"))
def gated_delta_commit(state: torch.Tensor, conv: torch.Tensor, step_k: torch.Tensor, step_u: torch.Tensor,
                       step_decay: torch.Tensor, step_inputs: torch.Tensor, paths: torch.Tensor,
                       rows: torch.Tensor) -> None:
    """Same signature and effect as gated_delta_commit_reference (every tensor contiguous)."""
    check_commit(state, conv, step_k, step_u, step_decay, step_inputs, paths, rows)
    (layers, n, h, dk, dv), (sb, s), (b, p) = state.shape, step_k.shape[1:3], paths.shape
    bp, bv = max(16, triton.next_power_of_2(p)), value_tile(dv)
    _fold_state[(layers * b * h, triton.cdiv(dv, bv))](state, step_k, step_u, step_decay, paths, rows, b, n, sb, p, h,
                                                         s, DK=dk, DV=dv, BP=bp, BK=max(16, triton.next_power_of_2(dk)),
                                                         BV=bv)
    fold_conv(conv, step_inputs, paths, rows)


def check_commit(state: torch.Tensor, conv: torch.Tensor, step_k: torch.Tensor, step_u: torch.Tensor,
                 step_decay: torch.Tensor, step_inputs: torch.Tensor, paths: torch.Tensor, rows: torch.Tensor) -> None:
    """Assert a commit's tensors are what the fold kernels take."""
    assert all(x.is_contiguous() for x in (state, conv, step_k, step_u, step_decay, step_inputs, paths, rows)), \
        "needs contiguous tensors"
    assert rows.shape == paths.shape[:1] and paths.shape[0] <= step_k.shape[1] and conv.shape[1] == state.shape[1], \
        "a path and a request slot per tree, a step row per tree"


def fold_conv(conv: torch.Tensor, step_inputs: torch.Tensor, paths: torch.Tensor, rows: torch.Tensor) -> None:
    """The conv windows [L, N, K - 1, C] of slots `rows` advanced along `paths` (as gated_delta_commit; contiguous)."""
    (layers, n, kept, c), (sb, s), (b, p) = conv.shape, step_inputs.shape[1:3], paths.shape
    bc = 128
    _fold_conv[(layers * b, triton.cdiv(c, bc))](conv, step_inputs, paths, rows, b, n, sb, p, s, c, KEPT=kept,
                                                 BP=max(16, triton.next_power_of_2(p)), BR=triton.next_power_of_2(kept),
                                                 BC=bc)
