"""The DSA indexer's KL loss for one layer, in query tiles: KL(p_t || softmax(I_t)) summed over queries.

p_t is the main attention's probability mass per pool (summed over heads and over the pool's kpool tokens,
L1-normalised over the support); I_t the indexer scores (ops/indexer_topk.py). Two supports:
- sparse (`indexer_kl_sparse`, DeepSeek-V3.2's sparse stage): the pools query t selected; p_t is the sparse
  attention's own softmax over its K selected tokens (the tail tokens count in that softmax but belong to no
  complete pool, so their mass is left out).
- dense (`indexer_kl_dense`, the dense warm-up and the sparse stage without the sparse loss): every candidate
  pool; p_t is dense causal attention within the document, over query tiles (O(T^2) work, O(tile x T) memory).
The main attention is given in the absorbed MLA form (ops/sparse_mla.py): queries attn_q [B, T, H, R] against
the latent attn_kv [B, T, R], which are the key and the value. Both are constants here (no gradient).

Both ops return (kl_sum, rows, dq, dw, dpk): the KL summed over the queries with a non-empty support, the number of
such queries, and, when need_grad, d kl_sum / d(q, w, pk). The gradient is formed in the forward pass: the target
is a constant and kl_sum is a scalar, so backward only scales it by the incoming gradient, and neither the [T, P]
target nor the dense attention is ever recomputed or saved (saved memory O(T)). Queries with an empty support
count nowhere. Rows with support but an all-zero target (its mass underflowed) count with KL 0.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

from .indexer_topk import index_scores, query_tiles, visible
from .sparse_mla import _flat_indices, sparse_mla_head_probs

__all__ = ["indexer_kl_dense", "indexer_kl_sparse"]


def _kl_tile(scores: Tensor, support: Tensor, mass: Tensor, need_grad: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(KL sum, counted rows, d KL / d scores or None) of one tile; mass [n, W] >= 0 is zero off the support."""
    target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-20)
    logq = torch.log_softmax(scores.masked_fill(~support, float("-inf")), dim=-1)
    # `target != 0` rather than `> 0`: a NaN target (NaN attention upstream) must make the KL NaN, not 0.
    terms = torch.where(target != 0, target * (torch.log(target.clamp_min(1e-30)) - logq), torch.zeros_like(target))
    rows = support.any(-1)  # rows without support have target 0, hence terms 0
    kl = terms.sum()
    grad = None
    if need_grad:
        grad = torch.where(support & rows[:, None], logq.exp() - target, torch.zeros_like(target))
    return kl, rows.sum(), grad


@contextlib.contextmanager
def exact_tf32(enabled: bool) -> Iterator[None]:
    """CUDA matmuls in TF32 while enabled, for FP32 copies of BF16 tensors: BF16's 8-bit significand fits TF32's 11
    bits, so no input is rounded, each product is exact in FP32 and the sums stay FP32. The result is the FP32
    matmul's up to summation order, at tensor-core rate: without it the dense KL target's attention logits ran as
    FP32 FFMA GEMMs, 47.5 ms of the proxy's 760 ms training step on the H200 (2026-12-04 profile,
    docs/performance.md). (The sparse KL's target comes from a Triton kernel on CUDA: sparse_mla_head_probs.) Only
    torch's fp32_precision API is used (mixing it with allow_tf32 is an error)."""
    if not enabled:
        yield
        return
    matmul = torch.backends.cuda.matmul
    prev = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = prev


def _bf16_on_cuda(*tensors: Tensor) -> bool:
    return all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors)


def _score_grads(w: Tensor, r: Tensor, dscores: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Backprop d/dI [n, W] through I = sum_h w_h relu(q_h . pk_p * d^-1/2): (d/d(q_h . pk_p) [n, H, W], d/dw [n, H]);
    callers contract the first with pk for d/dq and with q for d/dpk."""
    dr = w.unsqueeze(-1) * dscores.unsqueeze(-2)  # [n, H, W]
    ds = torch.where(r > 0, dr, torch.zeros_like(dr)) * dim**-0.5
    return ds, (r * dscores.unsqueeze(-2)).sum(-1)


def _empty_grads(q: Tensor, w: Tensor, pk: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(0), w.new_empty(0), pk.new_empty(0)


def indexer_kl_sparse_tiled(
    q: Tensor, w: Tensor, pk: Tensor, pool_ids: Tensor, attn_q: Tensor, attn_kv: Tensor, indices: Tensor, *,
    scale: float, kpool: int, tile: int, need_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Sparse-stage KL (module docstring). pool_ids [B, T, k] selected slots (-1 none); indices [B, T, K] the tokens
    the attention used, whose first k * kpool entries are those pools' tokens in pool_ids order."""
    bsz, seqlen, heads_i, dim_i = q.shape
    num_slots, k = pk.shape[1], pool_ids.shape[-1]
    n_all = bsz * seqlen
    ct = torch.promote_types(q.dtype, torch.float32)
    qf, wf = q.reshape(n_all, heads_i, dim_i).to(ct), w.reshape(n_all, heads_i).to(ct)
    pkf = pk.reshape(-1, dim_i).to(ct)
    offset = (torch.arange(bsz, device=q.device) * num_slots).view(bsz, 1, 1)
    gp = torch.where(pool_ids >= 0, pool_ids + offset, -1).view(n_all, k)
    aq, akv = attn_q.reshape(n_all, *attn_q.shape[2:]), attn_kv.reshape(-1, attn_kv.shape[-1])
    gi = _flat_indices(indices, attn_kv.shape[1])
    kl_sum, rows = torch.zeros((), dtype=ct, device=q.device), torch.zeros((), dtype=ct, device=q.device)
    dq, dw, dpk = (torch.zeros_like(qf), torch.zeros_like(wf), torch.zeros_like(pkf)) if need_grad else (None,) * 3
    for s in range(0, n_all if k else 0, tile):  # k = 0 (fewer than kpool tokens): no pool, no counted query
        e = min(s + tile, n_all)
        sel = gp[s:e]
        support = sel >= 0
        pks = pkf[sel.clamp(min=0)]  # [n, k, d]
        r = torch.relu(torch.bmm(qf[s:e], pks.transpose(1, 2)) * dim_i**-0.5)  # [n, H, k]
        scores = torch.bmm(wf[s:e].unsqueeze(1), r).squeeze(1)
        with torch.no_grad():
            # the attention's probabilities over its K tokens, summed over heads ([n, K]; Triton on CUDA)
            probs = sparse_mla_head_probs(aq[s:e], akv, gi[s:e], scale=scale).to(ct)
            mass = probs[:, : k * kpool].reshape(-1, k, kpool).sum(-1) * support
        kl, n_rows, dscores = _kl_tile(scores, support, mass, need_grad)
        kl_sum, rows = kl_sum + kl, rows + n_rows
        if need_grad:
            ds, dw_t = _score_grads(wf[s:e], r, dscores, dim_i)
            dq[s:e] = torch.bmm(ds, pks)
            dw[s:e] = dw_t
            dpk.index_add_(0, sel.clamp(min=0).flatten(), torch.bmm(ds.transpose(1, 2), qf[s:e]).flatten(0, 1))
    if not need_grad:
        return kl_sum.to(torch.float32), rows.to(torch.float32), *_empty_grads(q, w, pk)
    return (kl_sum.to(torch.float32), rows.to(torch.float32), dq.view_as(q).to(q.dtype), dw.view_as(w).to(w.dtype),
            dpk.view_as(pk).to(pk.dtype))


def indexer_kl_dense_tiled(
    q: Tensor, w: Tensor, pk: Tensor, pool_start: Tensor, pool_last: Tensor, pool_key: Tensor, doc_key: Tensor,
    attn_q: Tensor, attn_kv: Tensor, *, scale: float, kpool: int, tile: int, need_grad: bool, q_start: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Dense KL (module docstring) over every candidate pool (ops/indexer_topk.py's rule); pool_start [B, P] is each
    slot's first token. Work per tile: queries t0..t1 against keys < t1 and slots < t1 // kpool. doc_key and
    attn_kv cover the whole row; query i sits at position q_start + i (context parallelism: a rank's chunk)."""
    bsz, seqlen, _, dim_i = q.shape
    num_slots = pk.shape[1]
    ct = torch.promote_types(q.dtype, torch.float32)
    qc, wc, pkc = q.to(ct), w.to(ct), pk.to(ct)
    akv = attn_kv.to(ct)  # the latent [B, T, R] once; the queries [B, T, H, R] (H times larger) per tile
    kl_sum, rows = torch.zeros((), dtype=ct, device=q.device), torch.zeros((), dtype=ct, device=q.device)
    dq, dw, dpk = (torch.zeros_like(qc), torch.zeros_like(wc), torch.zeros_like(pkc)) if need_grad else (None,) * 3
    slot_tokens = pool_start.unsqueeze(-1) + torch.arange(kpool, device=q.device)  # [B, P, kpool]
    tf32 = _bf16_on_cuda(attn_q, attn_kv)  # the target's logits from BF16 values: TF32 is exact (exact_tf32)
    for b, t0, t1, width in query_tiles(bsz, seqlen, num_slots, tile=tile, kpool=kpool, offset=q_start):
        p0, p1 = q_start + t0, q_start + t1  # the tile's row positions
        scores, r = index_scores(qc[b, t0:t1], wc[b, t0:t1], pkc[b, :width])
        support = visible(pool_last[b, :width], pool_key[b, :width], doc_key[b, p0:p1], p0)
        with torch.no_grad(), exact_tf32(tf32):
            t = torch.arange(p0, p1, device=q.device)
            allowed = (torch.arange(p1, device=q.device)[None, :] <= t[:, None]) & (
                doc_key[b, None, :p1] == doc_key[b, p0:p1, None])
            logits = torch.matmul(attn_q[b, t0:t1].to(ct), akv[b, :p1].t()) * scale  # [n, H, p1]
            probs = logits.masked_fill(~allowed[:, None], float("-inf")).softmax(-1).sum(1)  # [n, p1]
            tokens = slot_tokens[b, :width].clamp(max=p1 - 1).flatten()  # slots ending past p1 are not visible
            mass = probs[:, tokens].view(-1, width, kpool).sum(-1) * support
        kl, n_rows, dscores = _kl_tile(scores, support, mass, need_grad)
        kl_sum, rows = kl_sum + kl, rows + n_rows
        if need_grad:
            ds, dw_t = _score_grads(wc[b, t0:t1], r, dscores, dim_i)
            dq[b, t0:t1] = torch.matmul(ds, pkc[b, :width])
            dw[b, t0:t1] = dw_t
            dpk[b, :width] += torch.matmul(ds.flatten(0, 1).t(), qc[b, t0:t1].flatten(0, 1))
    if not need_grad:
        return kl_sum.to(torch.float32), rows.to(torch.float32), *_empty_grads(q, w, pk)
    return kl_sum.to(torch.float32), rows.to(torch.float32), dq.to(q.dtype), dw.to(w.dtype), dpk.to(pk.dtype)


# ---------------------------------------------------------------------------------------------
# Custom ops: opaque to compile (the tile loops stay out of the graph), gradient precomputed
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("torchtitan_glm::indexer_kl_sparse", mutates_args=())
def indexer_kl_sparse(
    q: Tensor, w: Tensor, pk: Tensor, pool_ids: Tensor, attn_q: Tensor, attn_kv: Tensor, indices: Tensor,
    scale: float, kpool: int, tile: int, need_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(kl_sum, rows, dq, dw, dpk) over the selected pools (module docstring)."""
    with torch.no_grad():
        return indexer_kl_sparse_tiled(q, w, pk, pool_ids, attn_q, attn_kv, indices, scale=scale, kpool=kpool,
                                       tile=tile, need_grad=need_grad)


@torch.library.custom_op("torchtitan_glm::indexer_kl_dense", mutates_args=())
def indexer_kl_dense(
    q: Tensor, w: Tensor, pk: Tensor, pool_start: Tensor, pool_last: Tensor, pool_key: Tensor, doc_key: Tensor,
    attn_q: Tensor, attn_kv: Tensor, scale: float, kpool: int, tile: int, need_grad: bool, q_start: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(kl_sum, rows, dq, dw, dpk) over every candidate pool (module docstring)."""
    with torch.no_grad():
        return indexer_kl_dense_tiled(q, w, pk, pool_start, pool_last, pool_key, doc_key, attn_q, attn_kv,
                                      scale=scale, kpool=kpool, tile=tile, need_grad=need_grad, q_start=q_start)


def _fake(q: Tensor, w: Tensor, pk: Tensor, need_grad: bool):
    scalar = q.new_empty((), dtype=torch.float32)
    grads = (torch.empty_like(q, memory_format=torch.contiguous_format),
             torch.empty_like(w, memory_format=torch.contiguous_format),
             torch.empty_like(pk, memory_format=torch.contiguous_format)) if need_grad else _empty_grads(q, w, pk)
    return scalar, scalar.clone(), *grads


@indexer_kl_sparse.register_fake
def _indexer_kl_sparse_fake(q, w, pk, pool_ids, attn_q, attn_kv, indices, scale, kpool, tile, need_grad):
    return _fake(q, w, pk, need_grad)


@indexer_kl_dense.register_fake
def _indexer_kl_dense_fake(q, w, pk, pool_start, pool_last, pool_key, doc_key, attn_q, attn_kv, scale, kpool, tile,
                           need_grad, q_start=0):
    return _fake(q, w, pk, need_grad)


def _setup_context(ctx, inputs, output) -> None:
    _, rows, dq, dw, dpk = output
    ctx.mark_non_differentiable(rows, dq, dw, dpk)
    ctx.save_for_backward(dq, dw, dpk)
    ctx.num_inputs = len(inputs)
    ctx.need_grad = dq.numel() > 0 or inputs[0].numel() == 0  # need_grad=False returns empty gradients


def _backward(ctx, dkl, *_):
    if not ctx.need_grad:
        raise RuntimeError("indexer KL op ran with need_grad=False but its result was differentiated")
    dq, dw, dpk = ctx.saved_tensors
    return (dq * dkl, dw * dkl, dpk * dkl) + (None,) * (ctx.num_inputs - 3)


torch.library.register_autograd("torchtitan_glm::indexer_kl_sparse", _backward, setup_context=_setup_context)
torch.library.register_autograd("torchtitan_glm::indexer_kl_dense", _backward, setup_context=_setup_context)
