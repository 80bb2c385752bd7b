"""Attention under an explicit [B, Tq, Tk] boolean token mask: the DSA layer's dense warm-up stage and its short
sparse-stage rows (the selection as a mask, model.dsa_dense_max_len).

SDPA with a dense boolean mask compiles without graph breaks on CPU and CUDA, but every backend that takes an
arbitrary mask computes every (query, key) pair it is given, whatever the mask holds, and the mask is quadratic in
T; the long sparse stage attends gathered token indices instead (ops/sparse_mla.py). For a causal mask the call is
split into query chunks, each given only the keys up to its last query: chunk i of n computes (i + 1) / n of the
row, (n + 1) / (2n) of the pairs in all (5/8 for 4 chunks) instead of every one. (FlexAttention, which would skip
the mask's empty tiles itself, measured slower than this kernel under a selection mask: docs/performance.md,
eighteenth session.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_keys_per_query(seq: int, causal_chunk: int) -> float:
    """Keys each query of a row of `seq` tokens is computed against, on average, by masked_attention: the whole
    row, or with causal_chunk each chunk's keys up to its last query."""
    if causal_chunk <= 0 or seq <= causal_chunk:
        return float(seq)
    return sum(min(s0 + causal_chunk, seq) * (min(s0 + causal_chunk, seq) - s0)
               for s0 in range(0, seq, causal_chunk)) / seq


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float,
                     causal_chunk: int = 0) -> torch.Tensor:
    """q [B, H, Tq, Dqk], k [B, H, Tk, Dqk], v [B, H, Tk, Dv], mask [B, Tq, Tk] (True = attend) -> [B, H, Tq, Dv].

    causal_chunk > 0 (needs Tq == Tk and a mask in which no query attends a later key, which the caller
    guarantees): queries in chunks of that many rows, each over the keys up to its last query. The same function;
    chunks compute fewer pairs."""
    tq, tk = mask.shape[1:]
    if causal_chunk <= 0 or tq <= causal_chunk:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale)
    if tq != tk:
        raise ValueError(f"masked_attention: causal_chunk needs as many queries as keys, got {tq} and {tk}")
    outs = []
    for s0 in range(0, tq, causal_chunk):
        s1 = min(s0 + causal_chunk, tq)
        outs.append(F.scaled_dot_product_attention(q[:, :, s0:s1], k[:, :, :s1], v[:, :, :s1],
                                                   attn_mask=mask[:, None, s0:s1, :s1], scale=scale))
    return torch.cat(outs, dim=2)
