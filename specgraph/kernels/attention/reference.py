"""Reference step attention: PyTorch SDPA over the first `width` cache slots under the mask.

With width = the cache's capacity (static shapes, for CUDA graphs) it reads every slot's keys and
values whether or not any query sees them; the Triton kernel stops after the last written slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, K]; k_cache, v_cache [B, Hkv, S, K]; mask [T, W] bool (True = visible, W <= S);
    slots [T]: where the queries' own keys were written (every visible slot is at most their max).
    Returns [B, H, T, K] in q's dtype, softmax scale 1/sqrt(K)."""
    width = mask.shape[1]
    # enable_gqa always (a group of one when H == Hkv): computed from the shapes it would be a
    # symbolic bool under torch.compile with dynamic head counts, which SDPA refuses
    return F.scaled_dot_product_attention(q, k_cache[:, :, :width], v_cache[:, :, :width], attn_mask=mask,
                                          enable_gqa=True)
