"""Attention under an explicit [B, Tq, Tk] boolean token mask: the DSA layer's dense warm-up stage and its short
sparse-stage rows (the selection as a mask, model.dsa_dense_max_len).

SDPA with a dense boolean mask compiles without graph breaks on CPU and CUDA, but every backend that takes an
arbitrary mask computes every (query, key) pair it is given, whatever the mask holds, and the mask is quadratic in
T; the long sparse stage attends gathered token indices instead (ops/sparse_mla.py). Two cuts, both the same
function:
- causal query chunks: each chunk of queries is given only the keys up to its last query; chunk i of n computes
  (i + 1) / n of the row, (n + 1) / (2n) of the pairs in all (5/8 for 4 chunks);
- plain causal rows: where the caller knows the first rows' mask is exactly causal (one document per row, and a
  selection that still holds every past token: DSA's first index_topk + index_kpool - 1 queries), those rows run
  SDPA's causal kernel with no mask, which skips the masked-out half of their tiles and reads no mask.
(FlexAttention, which would skip the mask's empty tiles itself, measured slower than this kernel under a selection
mask: docs/performance.md, eighteenth session.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_keys_per_query(seq: int, causal_chunk: int, causal_rows: int = 0) -> tuple[float, float]:
    """Returns (keys under the mask, keys in the causal kernel): how many keys masked_attention computes each query
    of a `seq`-token row against, on average. Under the mask: the rows after the causal ones, each chunk over the
    keys up to its last query (without chunks, up to the row's end); in the causal kernel: the causal rows' own."""
    plain = min(max(causal_rows, 0), seq)
    causal = plain * (plain + 1) / 2 / seq
    if causal_chunk <= 0:
        return float(seq - plain), causal
    masked = sum(min(s0 + causal_chunk, seq) * (min(s0 + causal_chunk, seq) - s0)
                 for s0 in range(plain, seq, causal_chunk)) / seq
    return masked, causal


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, scale: float,
                     causal_chunk: int = 0, causal_rows: int = 0) -> torch.Tensor:
    """q [B, H, Tq, Dqk], k [B, H, Tk, Dqk], v [B, H, Tk, Dv], mask [B, Tq, Tk] (True = attend) -> [B, H, Tq, Dv].

    causal_chunk > 0 (needs Tq == Tk and a mask in which no query attends a later key, which the caller
    guarantees): queries in chunks of that many rows, each over the keys up to its last query.
    causal_rows > 0 (needs Tq == Tk; the caller guarantees the mask's first causal_rows rows are exactly causal):
    those rows run the causal kernel without the mask; mask may be None when they are all of them.
    The same function either way; fewer pairs are computed."""
    tq, tk = q.shape[2], k.shape[2]
    if (tq > causal_chunk > 0 or causal_rows > 0) and tq != tk:
        raise ValueError(f"masked_attention: causal_chunk / causal_rows need as many queries as keys, got {tq} and "
                         f"{tk}")
    plain = min(max(causal_rows, 0), tq)
    if plain == tq:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if mask is None:
        raise ValueError("masked_attention: a mask is needed unless every row is causal (causal_rows >= T)")
    if plain == 0 and (causal_chunk <= 0 or tq <= causal_chunk):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale)
    outs = []
    if plain:
        outs.append(F.scaled_dot_product_attention(q[:, :, :plain], k[:, :, :plain], v[:, :, :plain],
                                                   is_causal=True, scale=scale))
    step = causal_chunk if causal_chunk > 0 else tq
    for s0 in range(plain, tq, step):
        s1 = min(s0 + step, tq)
        # without chunks the rest is one call over every key (the mask is not known to be causal there)
        s_keys = s1 if causal_chunk > 0 else tk
        outs.append(F.scaled_dot_product_attention(q[:, :, s0:s1], k[:, :, :s_keys], v[:, :, :s_keys],
                                                   attn_mask=mask[:, None, s0:s1, :s_keys], scale=scale))
    return torch.cat(outs, dim=2)
