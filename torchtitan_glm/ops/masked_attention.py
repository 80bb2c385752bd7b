"""Attention under an explicit [B, Tq, Tk] boolean token mask: the DSA layer's dense warm-up stage only.

SDPA with a dense boolean mask compiles without graph breaks on CPU and CUDA, but its mask is quadratic in T; the
sparse stage attends gathered token indices instead (ops/sparse_mla.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float) -> torch.Tensor:
    """q, k [B, H, T, Dqk], v [B, H, T, Dv], mask [B, T, T] (True = attend) -> [B, H, T, Dv]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale)
