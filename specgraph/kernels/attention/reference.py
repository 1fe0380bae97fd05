"""Reference step attention over a paged cache: PyTorch SDPA per segment, over the virtual slots of
the blocks its table row holds (the layout cuts the table to the blocks a step may see), gathered
through the block table, under its prefix + region mask (specgraph/layout.py). It reads those
blocks' keys and values whether or not any query sees them; the Triton kernels stop after each
segment's last visible slot."""

from __future__ import annotations

import torch
import torch.nn.functional as F



def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                        rows: torch.Tensor, cu: torch.Tensor, starts: torch.Tensor, visible: torch.Tensor,
                        reach: torch.Tensor, grid: torch.Tensor, tickets: torch.Tensor, block_size: int,
                        padded: bool = True) -> torch.Tensor:
    """q [1, H, T, K] (T packed tokens); k_cache, v_cache [1, Hkv, S, K] (S physical slots); the
    layout's table [rows, M], rows [R], cu [R + 1], starts [R], visible [T, G], reach [T] (the Triton
    kernel's bound: unused here), grid [R, G], tickets (the Triton kernel's zeroed scratch: unused here), block size and whether padding tokens may be there
    (unused: they are zeroed here anyway) (Layout.attention_inputs). Returns [1, H, T, K] in q's dtype (padding tokens: 0), softmax scale
    1/sqrt(K)."""
    (r, g), (hkv, k) = grid.shape, k_cache.shape[1::2]
    width = table.shape[1] * block_size
    blocks = table.index_select(0, rows).flatten()  # [R M]: each segment's blocks
    keys, values = (cache[0].view(hkv, -1, block_size, k).index_select(1, blocks).view(hkv, r, width, k)
                    .transpose(0, 1) for cache in (k_cache, v_cache))  # [R, Hkv, W, K]: each segment's virtual slots
    token = grid.clamp(min=0).flatten()  # [R G]
    queries = q[0].index_select(1, token).view(q.shape[1], r, g, -1).transpose(0, 1)  # [R, H, G, K]
    offset = torch.arange(width, device=q.device)[None, :] - starts[:, None]  # [R, W]: virtual slot - region start
    seen = visible.index_select(0, token).view(r, g, g).gather(2, offset.clamp(0, g - 1)[:, None, :].expand(-1, g, -1))
    mask = (offset[:, None, :] < 0) | (seen & (offset[:, None, :] < g))  # [R, G, W]
    mask = mask | (grid < 0)[..., None]  # (rows past a segment's tokens see everything: unused, never NaN)
    # enable_gqa always (a group of one when H == Hkv): computed from the shapes it would be a
    # symbolic bool under torch.compile with dynamic head counts, which SDPA refuses
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None], enable_gqa=True)  # [R, H, G, K]
    result = q.new_zeros(q.shape[1], q.shape[2] + 1, q.shape[3])  # [H, T + 1, K]: column T takes what no token is
    result.index_copy_(1, torch.where(grid >= 0, grid, q.shape[2]).flatten(), out.transpose(0, 1).flatten(1, 2))
    return result[None, :, : q.shape[2]]
