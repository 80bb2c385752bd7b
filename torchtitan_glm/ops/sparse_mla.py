"""Sparse MLA attention over gathered token indices, in the absorbed form (MQA over one shared latent).

GLM-5.3-Flash's DSA layers are NoPE MLA: with q̃_h = q_nope_h W_UK_h (in the kv_lora_rank latent) and c_s the
normalised latent of token s, head h attends with logit q̃_h · c_s · scale and reads the value c_s itself; the
caller maps the latent output back with W_UV_h. Every head of a query shares the same gathered keys, so a query
reads K · D latent values (D = 512: 2 MB for K = 2051 in BF16) instead of 64 heads' expanded keys and values.

    sparse_mla(q [B, T, H, D], kv [B, T, D], indices [B, T, K] int32, scale=s) -> out [B, T, H, D]

indices are token positions in the query's row, -1 = no token; a row's valid indices must be distinct (the caller's
selection is). A query without any valid index outputs 0. The custom ops `sparse_mla_fwd` (also returns the
log-sum-exp [B, T, H], -inf for such queries) and `sparse_mla_bwd` compile as opaque nodes. CPU (and CUDA under
torch.use_deterministic_algorithms): the torch reference below, which works in query tiles so it never holds more
than O(tile · K · D) floats. CUDA: Triton kernels (ops/sparse_mla_triton.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sparse_mla", "sparse_mla_reference", "sparse_mla_reference_bwd", "sparse_mla_head_probs"]

# Floats one reference tile may hold per [rows, K, D] gather (64 MiB in FP32); the tile is this over K * (D + H).
_TILE_ELEMENTS = 1 << 24


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # FP32, or FP64 for gradcheck


def _tile_rows(k: int, d: int, h: int) -> int:
    return max(1, _TILE_ELEMENTS // max(1, k * (d + h)))


def _flat_indices(indices: Tensor, kv_len: int) -> Tensor:
    """[B, T, K] row positions -> [B*T, K] int64 rows of the flattened [B*kv_len, D] kv; -1 stays -1. The keys may
    be more than the queries (context parallelism: this rank's queries against the whole row's latent)."""
    bsz, seqlen, k = indices.shape
    offset = (torch.arange(bsz, device=indices.device) * kv_len).view(bsz, 1, 1)
    idx = indices.long()
    return torch.where(idx >= 0, idx + offset, -1).view(bsz * seqlen, k)


def _tile_probs(q: Tensor, kvg: Tensor, valid: Tensor, lse: Tensor, scale: float) -> Tensor:
    """Attention probabilities [n, H, K] of one tile from the saved log-sum-exp (0 for invalid keys, empty rows)."""
    logits = torch.bmm(q, kvg.transpose(1, 2)) * scale
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    return torch.where(valid[:, None, :], (logits - lse[..., None]).exp(), torch.zeros_like(logits))


def sparse_mla_reference(q: Tensor, kv: Tensor, indices: Tensor, *, scale: float) -> tuple[Tensor, Tensor]:
    """(out [B, T, H, D] in q's dtype and memory layout, lse [B, T, H] in FP32, FP64 for FP64 inputs), in query
    tiles."""
    bsz, seqlen, heads, dim = q.shape
    k = indices.shape[-1]
    ct = _compute_dtype(q)
    qf, kvf, gi = q.reshape(bsz * seqlen, heads, dim), kv.reshape(-1, dim), _flat_indices(indices, kv.shape[1])
    out = q.new_zeros(bsz * seqlen, heads, dim)
    lse = torch.full((bsz * seqlen, heads), float("-inf"), dtype=ct, device=q.device)
    rows = _tile_rows(k, dim, heads)
    for s in range(0, bsz * seqlen if k else 0, rows):  # K = 0: every query is empty
        e = min(s + rows, bsz * seqlen)
        idx = gi[s:e]
        valid = idx >= 0
        kvg = kvf[idx.clamp(min=0)].to(ct)  # [n, K, D]
        logits = (torch.bmm(qf[s:e].to(ct), kvg.transpose(1, 2)) * scale).masked_fill(~valid[:, None, :], float("-inf"))
        m = logits.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        ex = (logits - m).exp()  # 0 for invalid keys
        denom = ex.sum(-1, keepdim=True)
        out[s:e] = (torch.bmm(ex, kvg) / denom.clamp_min(torch.finfo(ct).tiny)).to(out.dtype)
        lse[s:e] = (m + denom.log()).squeeze(-1)  # -inf where no key is valid
    return torch.empty_like(q).copy_(out.view(q.shape)), lse.view(bsz, seqlen, heads)


def sparse_mla_reference_bwd(
    dout: Tensor, q: Tensor, kv: Tensor, indices: Tensor, out: Tensor, lse: Tensor, *, scale: float,
) -> tuple[Tensor, Tensor]:
    """(dq, dkv) by per-tile recompute from the saved lse; dkv accumulated with index_add_ (deterministic on CPU and
    under torch.use_deterministic_algorithms on CUDA)."""
    bsz, seqlen, heads, dim = q.shape
    k = indices.shape[-1]
    ct = _compute_dtype(q)
    n_all = bsz * seqlen
    qf, kvf, gi = q.reshape(n_all, heads, dim), kv.reshape(-1, dim), _flat_indices(indices, kv.shape[1])
    dof, of, lsef = dout.reshape(n_all, heads, dim), out.reshape(n_all, heads, dim), lse.reshape(n_all, heads)
    dq = torch.zeros(n_all, heads, dim, dtype=ct, device=q.device)
    dkv = torch.zeros(kvf.shape[0], dim, dtype=ct, device=q.device)
    rows = _tile_rows(k, dim, heads)
    for s in range(0, n_all if k else 0, rows):
        e = min(s + rows, n_all)
        idx = gi[s:e]
        kvg = kvf[idx.clamp(min=0)].to(ct)
        qt, dot = qf[s:e].to(ct), dof[s:e].to(ct)
        p = _tile_probs(qt, kvg, idx >= 0, lsef[s:e].to(ct), scale)
        dp = torch.bmm(dot, kvg.transpose(1, 2))
        delta = (dot * of[s:e].to(ct)).sum(-1, keepdim=True)
        ds = p * (dp - delta)  # d loss / d logit (before the scale)
        dq[s:e] = torch.bmm(ds, kvg) * scale
        contrib = torch.bmm(ds.transpose(1, 2), qt) * scale + torch.bmm(p.transpose(1, 2), dot)  # [n, K, D]
        dkv.index_add_(0, idx.clamp(min=0).flatten(), contrib.flatten(0, 1))  # invalid slots add exact zeros
    return torch.empty_like(q).copy_(dq.view(q.shape)), dkv.view(kv.shape).to(kv.dtype)


def sparse_mla_head_probs_reference(q: Tensor, kv: Tensor, indices: Tensor, *, scale: float) -> Tensor:
    """sparse_mla_head_probs for one tile of queries, in torch: [n, H, K] logits, then the softmax summed over
    heads (FP32, FP64 for FP64 inputs)."""
    ct = _compute_dtype(q)
    valid = indices >= 0
    kvg = kv[indices.clamp(min=0)].to(ct)  # [n, K, D], gathered in kv's dtype, then cast
    logits = (torch.bmm(q.to(ct), kvg.transpose(1, 2)) * scale).masked_fill(~valid[:, None, :], float("-inf"))
    any_token = valid.any(-1)[:, None, None]  # queries with no token: 0, not the softmax's NaN
    return torch.where(any_token, logits.softmax(-1), torch.zeros_like(logits)).sum(1)


def sparse_mla_head_probs(q: Tensor, kv: Tensor, indices: Tensor, *, scale: float) -> Tensor:
    """[n, K]: each query's attention probabilities over its K indices summed over its H heads, 0 for -1 slots and
    for queries without any index. q [n, H, D], kv [M, D], indices [n, K] int64 rows of kv. No gradient: the sparse
    indexer KL's target (ops/indexer_kl.py). CUDA with 16-bit inputs and at most 64 heads: a Triton kernel (no
    [n, H, K] tensor, no atomics, so deterministic), else the torch reference."""
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype and q.shape[1] <= 64:
        from .sparse_mla_triton import sparse_mla_head_probs_triton

        with torch.cuda.device(q.device):
            return sparse_mla_head_probs_triton(q, kv, indices, scale=scale)
    return sparse_mla_head_probs_reference(q, kv, indices, scale=scale)


def _rows(x: Tensor) -> Tensor:
    """x when its last dim is contiguous (e.g. the head-major view the absorbing einsum returns; copying it would
    cost 8 GiB at T = 128K on the proxy), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q: Tensor, kv: Tensor, indices: Tensor) -> None:
    if q.ndim != 4 or kv.ndim != 3 or indices.ndim != 3:
        raise ValueError(f"sparse_mla: q must be [B, T, H, D], kv [B, S, D], indices [B, T, K]; got q "
                         f"{tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}")
    if kv.shape[0] != q.shape[0] or kv.shape[-1] != q.shape[-1] or indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"sparse_mla: shapes disagree: q {tuple(q.shape)}, kv {tuple(kv.shape)}, "
                         f"indices {tuple(indices.shape)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_mla: indices must be int32 or int64, got {indices.dtype}")


def _use_triton(q: Tensor) -> bool:
    """The Triton kernels run the 16-bit training dtypes; FP32 (a check, not a training path) and deterministic mode
    take the tiled reference. On the H200 (2026-12-03) the FP32 kernels at H=64, D=512 failed their GPU test while the
    BF16 ones passed at T = 4096 and 8192, so FP32 is not dispatched to them."""
    return not torch.are_deterministic_algorithms_enabled() and q.dtype in (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("torchtitan_glm::sparse_mla_fwd", mutates_args=(), device_types="cpu")
def sparse_mla_fwd(q: Tensor, kv: Tensor, indices: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(out [B, T, H, D], lse [B, T, H]) of attention restricted to `indices` (see module docstring)."""
    with torch.autocast("cpu", enabled=False):
        return sparse_mla_reference(q, kv, indices, scale=scale)


@sparse_mla_fwd.register_kernel("cuda")
def _sparse_mla_fwd_cuda(q, kv, indices, scale):
    with torch.cuda.device(q.device), torch.autocast("cuda", enabled=False):
        if _use_triton(q):
            from .sparse_mla_triton import sparse_mla_fwd_triton

            return sparse_mla_fwd_triton(q, kv, indices, scale=scale)
        return sparse_mla_reference(q, kv, indices, scale=scale)


@sparse_mla_fwd.register_fake
def _sparse_mla_fwd_fake(q, kv, indices, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_compute_dtype(q))  # out in q's layout


@torch.library.custom_op("torchtitan_glm::sparse_mla_bwd", mutates_args=(), device_types="cpu")
def sparse_mla_bwd(
    dout: Tensor, q: Tensor, kv: Tensor, indices: Tensor, out: Tensor, lse: Tensor, scale: float,
) -> tuple[Tensor, Tensor]:
    """(dq, dkv) of sparse_mla_fwd."""
    with torch.autocast("cpu", enabled=False):
        return sparse_mla_reference_bwd(dout, q, kv, indices, out, lse, scale=scale)


@sparse_mla_bwd.register_kernel("cuda")
def _sparse_mla_bwd_cuda(dout, q, kv, indices, out, lse, scale):
    with torch.cuda.device(q.device), torch.autocast("cuda", enabled=False):
        if _use_triton(q):
            from .sparse_mla_triton import sparse_mla_bwd_triton

            return sparse_mla_bwd_triton(dout, q, kv, indices, out, lse, scale=scale)
        return sparse_mla_reference_bwd(dout, q, kv, indices, out, lse, scale=scale)


@sparse_mla_bwd.register_fake
def _sparse_mla_bwd_fake(dout, q, kv, indices, out, lse, scale):
    return torch.empty_like(q), torch.empty_like(kv, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    q, kv, indices, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, kv, indices, out, lse)
    ctx.scale = scale


def _backward(ctx, dout, _dlse):
    q, kv, indices, out, lse = ctx.saved_tensors
    dq, dkv = torch.ops.torchtitan_glm.sparse_mla_bwd(_rows(dout), q, kv, indices, out, lse, ctx.scale)
    return dq, dkv, None, None


torch.library.register_autograd("torchtitan_glm::sparse_mla_fwd", _backward, setup_context=_setup_context)


def sparse_mla(q: Tensor, kv: Tensor, indices: Tensor, *, scale: float) -> Tensor:
    """Attention of each query's H heads over its gathered latent tokens (see module docstring): [B, T, H, D] in q's
    memory layout (any layout whose last dim is contiguous is used as it is)."""
    _check(q, kv, indices)
    out, _ = torch.ops.torchtitan_glm.sparse_mla_fwd(_rows(q), kv.contiguous(), indices.contiguous(), scale)
    return out
