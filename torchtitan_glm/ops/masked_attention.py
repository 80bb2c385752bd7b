"""Attention under an explicit [B, Tq, Tk] boolean token mask: the DSA layer's dense warm-up stage and its short
sparse-stage rows (the selection as a mask, model.dsa_dense_max_len).

Two kernels compute the same function (model.dsa_masked_kernel):
- "sdpa": SDPA with the boolean mask. Every backend that takes an arbitrary mask computes every (query, key) pair
  and reads the mask, so its cost is that of T x T pairs whatever the mask holds.
- "flex": torch's FlexAttention, with a BlockMask made from the same mask: 128 x 128 tiles that are all False are
  skipped (above the diagonal, across documents, pools no query of the tile selected), all-True tiles run without
  reading the mask. CUDA only for training (FlexAttention has no CPU backward); it needs torch.compile to be a
  kernel, so outside a compiled region the call goes through a compiled FlexAttention (one compile per shape).
Both compile without graph breaks; the mask stays quadratic in T, which is why long rows take the sparse kernel
(ops/sparse_mla.py) instead.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

def resolve_masked_kernel(kernel: str, device: torch.device) -> str:
    """model.dsa_masked_kernel for tensors on `device`: "auto" is FlexAttention on CUDA under torch.compile, SDPA
    otherwise (eager FlexAttention would compile itself once per new shape, e.g. per prompt length in generation)."""
    if kernel == "auto":
        return "flex" if device.type == "cuda" and torch.compiler.is_compiling() else "sdpa"
    return kernel


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float,
                     kernel: str = "sdpa") -> torch.Tensor:
    """q [B, H, Tq, Dqk], k [B, H, Tk, Dqk], v [B, H, Tk, Dv], mask [B, Tq, Tk] (True = attend; every query attends
    at least one key) -> [B, H, Tq, Dv]. kernel: "sdpa" or "flex" (resolve_masked_kernel)."""
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale)
    if kernel != "flex":
        raise ValueError(f"masked_attention: kernel must be 'sdpa' or 'flex', got {kernel!r}")
    if q.device.type != "cuda" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(f"dsa_masked_kernel='flex' trains on CUDA only (FlexAttention has no {q.device.type} "
                         "backward); use 'sdpa' or 'auto'")
    return flex_masked_attention(q, k, v, mask, scale=scale)


def flex_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                          scale: float) -> torch.Tensor:
    """masked_attention through FlexAttention: the BlockMask's tiles come from the mask, its mask_mod reads it."""
    bsz, tq, tk = mask.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[b, q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, bsz, None, tq, tk, device=q.device)
    attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    return attend(q, k, v, block_mask=block_mask, scale=scale)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """FlexAttention compiled once per process: called eagerly it would run its unfused reference, which holds the
    [B, H, Tq, Tk] scores."""
    return torch.compile(flex_attention, dynamic=False)
