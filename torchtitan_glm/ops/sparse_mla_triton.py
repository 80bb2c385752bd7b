"""Triton kernels of ops/sparse_mla.py (CUDA): forward with online softmax, backward with dq and dkv.

Why hand-written: no maintained library ships a Triton sparse MLA for training; FlashMLA's sparse kernels are
Hopper CUDA and forward-only, TileLang's (tile-ai/tilelang examples/deepseek_v32) need the TileLang compiler.

One program handles one query and BLOCK_H of its heads, looping over its K indices in blocks of BLOCK_K: the
gathered [BLOCK_K, D] latent rows are the keys and the values of every head in the block (MQA). The backward forms a
block's dkv transposed, [D, BLOCK_K], so that all 64 heads fit one program as wgmma products (see _BWD_CONFIGS).

dkv uses FP32 atomic adds into a [B, T, D] buffer: a key receives contributions from every query that selected it,
and any deterministic alternative needs the inverse selection (a sort of B*T*K indices) and then gathers each
selecting query's [H, D] query and output gradient per key, 64x the bytes of the forward's gather. TileLang's
DeepSeek-V3.2 sparse MLA backward makes the same choice (atomic dKV adds; ~115 TFLOPs reported on H200). The sum
order, hence the last bits of dkv, varies run to run; under torch.use_deterministic_algorithms the op runs the tiled
torch reference instead (index_add_, deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .sparse_mla import _rows

__all__ = ["BWD_CONFIGS", "sparse_mla_fwd_triton", "sparse_mla_bwd_triton", "sparse_mla_head_probs_triton"]

_LOG2E = 1.4426950408889634


def _prune(configs, named_args, **kwargs):
    """Drop head blocks wider than the head count needs (tl.dot wants at least 16 rows)."""
    need = max(16, triton.next_power_of_2(named_args["H"]))
    kept = [c for c in configs if c.kwargs["BLOCK_H"] <= need]
    return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_H"])]


_FWD_CONFIGS = [
    triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bh, bk, w, s in [(64, 32, 8, 2), (64, 64, 8, 2), (64, 16, 8, 1), (32, 32, 4, 2), (32, 64, 8, 2),
                         (16, 32, 4, 2), (16, 64, 4, 2)]
]
# The backward's configs, timed on the H200 (2026-12-04, T = 32,768, H = 64, D = 512, K = 2,051; docs/performance.md,
# "Ninth session"; scripts/bench_sparse_mla_configs.py times them): (64, 32, 8, 2) 150 ms, (64, 16, 8, 2) 199 ms,
# (32, 32, 8, 1) 251 ms, against 336 ms for the earlier [BLOCK_K, D] form's best, (32, 16, 8, 1). With all 64 heads in
# one program each key is gathered and its dkv added once, not twice, and every product is a wgmma.
BWD_CONFIGS = ((64, 32, 8, 2), (64, 16, 8, 2), (32, 32, 8, 1), (32, 16, 8, 1))  # BLOCK_H, BLOCK_K, warps, stages
_BWD_CONFIGS = [triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bh, bk, w, s in BWD_CONFIGS]


def _bwd_config_faults(block_h: int, block_k: int, num_stages: int, k: int) -> bool:
    """Whether Triton 3.6 builds a faulting backward for this config: with BLOCK_H = 64 the kernel hits an illegal
    address on the H200 unless its K loop is software-pipelined, i.e. num_stages >= 2 and at least two iterations
    (seen at K = 2,051 with (64, 16, 8, 1) and (64, 32, 8, 1), and at K = 16 with (64, 16, 8, 2) and (64, 32, 8, 2);
    K = 32, 48 and 2,051 with (64, 16, 8, 2) and K = 2,051 with (64, 32, 8, 2) ran and matched the reference;
    (32, 16, 8, 1) ran at K = 16, a one-iteration loop, too). A faulting config would end the process (the error
    is sticky), so none is offered."""
    return block_h > 32 and (num_stages < 2 or k < 2 * block_k)


def _prune_bwd(configs, named_args, **kwargs):
    k = kwargs.get("K", named_args.get("K"))
    safe = [c for c in configs if not _bwd_config_faults(c.kwargs["BLOCK_H"], c.kwargs["BLOCK_K"], c.num_stages, k)]
    return _prune(safe, named_args, **kwargs)


@triton.jit
def _fwd_kernel(
    Q, KV, IDX, OUT, LSE,
    T, H, scale_log2e,
    sq_b, sq_t, sq_h, skv_b, skv_t, si_b, si_t, so_b, so_t, so_h, sl_b, sl_t,
    K: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # x head strides of T * D: 64-bit
    offs_d = tl.arange(0, BLOCK_D)
    mh, md = offs_h < H, offs_d < D
    q = tl.load(Q + b * sq_b + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :],
                mask=mh[:, None] & md[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    idx_row = IDX + b * si_b + t * si_t
    kv_row = KV + b * skv_b
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_row + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
        valid = idx >= 0
        kv = tl.load(kv_row + idx[:, None] * skv_t + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale_log2e
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PRECISION)
        m_i = m_new
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) / 1.4426950408889634, float("-inf"))
    tl.store(OUT + b * so_b + t * so_t + offs_h[:, None] * so_h + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=mh[:, None] & md[None, :])
    tl.store(LSE + b * sl_b + t * sl_t + offs_h, lse, mask=mh)


@triton.jit
def _bwd_kernel(
    Q, KV, IDX, OUT, DO, LSE, DQ, DKV,
    T, H, scale, scale_log2e,
    sq_b, sq_t, sq_h, so_b, so_t, so_h, sdo_b, sdo_t, sdo_h, sdq_b, sdq_t, sdq_h, skv_b, skv_t, si_b, si_t, sl_b, sl_t,
    K: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # dkv (FP32) shares kv's strides.
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)  # x head strides of T * D: 64-bit
    offs_d = tl.arange(0, BLOCK_D)
    mh, md = offs_h < H, offs_d < D
    mhd = mh[:, None] & md[None, :]
    q = tl.load(Q + b * sq_b + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :], mask=mhd, other=0.0)
    do = tl.load(DO + b * sdo_b + t * sdo_t + offs_h[:, None] * sdo_h + offs_d[None, :], mask=mhd, other=0.0)
    o = tl.load(OUT + b * so_b + t * so_t + offs_h[:, None] * so_h + offs_d[None, :], mask=mhd, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # rowsum(dO * O) per head
    lse = tl.load(LSE + b * sl_b + t * sl_t + offs_h, mask=mh, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # empty rows: p = 0
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    q_t, do_t = tl.trans(q), tl.trans(do)
    idx_row = IDX + b * si_b + t * si_t
    kv_row = KV + b * skv_b
    dkv_row = DKV + b * skv_b
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_row + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
        valid = idx >= 0
        kv = tl.load(kv_row + idx[:, None] * skv_t + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale_log2e
        p = tl.where(valid[None, :] & mh[:, None], tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(kv), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kv.dtype), kv, input_precision=PRECISION)
        # dkv transposed, [D, BLOCK_K]: the MMA's rows are the latent's D (not the BLOCK_K keys), so with all heads in
        # one program every product is a Hopper wgmma and the program fits the SM (ptxas, sm_90: 176-208 KiB of
        # shared memory at BLOCK_H = 64, where the [BLOCK_K, D] products needed 288 KiB)
        dkv_t = tl.dot(q_t, (ds * scale).to(q.dtype), input_precision=PRECISION)
        dkv_t += tl.dot(do_t, p.to(do.dtype), input_precision=PRECISION)
        tl.atomic_add(dkv_row + idx[None, :] * skv_t + offs_d[:, None], dkv_t, mask=valid[None, :] & md[:, None],
                      sem="relaxed")
    dq_ptr = DQ + b * sdq_b + t * sdq_t + offs_h[:, None] * sdq_h + offs_d[None, :]
    tl.store(dq_ptr, (dq * scale).to(DQ.dtype.element_ty), mask=mhd)


@triton.jit
def _probs_kernel(
    Q, KV, IDX, P, scale_log2e, sq_n, sq_h, skv_m, si_n, sp_n,
    H: tl.constexpr, K: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one program per query, all its heads in one block (BLOCK_H >= H): the sum over heads stays in registers, and a
    # program writes each element of its P row once
    n = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    md = offs_d < D
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
    mh = offs_h < H
    idx_row = IDX + n * si_n
    q = tl.load(Q + n * sq_n + offs_h[:, None] * sq_h + offs_d[None, :], mask=mh[:, None] & md[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # pass 1: each head's log-sum-exp (base 2, scaled logits)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_row + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
        valid = idx >= 0
        kv = tl.load(KV + idx[:, None] * skv_m + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
        s = tl.where(valid[None, :], tl.dot(q, tl.trans(kv)) * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), 1)
        m_i = m_new
    # empty rows and padding heads: lse = +inf, so their probabilities are 0
    lse2 = tl.where(mh & (l_i > 0.0), m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("inf"))
    for k0 in range(0, K, BLOCK_K):  # pass 2: the probabilities, summed over the heads
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        idx = tl.load(idx_row + offs_k, mask=mk, other=-1).to(tl.int64)
        valid = idx >= 0
        kv = tl.load(KV + idx[:, None] * skv_m + offs_d[None, :], mask=valid[:, None] & md[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kv)) * scale_log2e
        p = tl.where(valid[None, :], tl.exp2(s - lse2[:, None]), 0.0)
        tl.store(P + n * sp_n + offs_k, tl.sum(p, 0), mask=mk)


# Up to 64 heads in one block (GLM-5.3-Flash has 64); ptxas for sm_90 at H = 64, D = 512: no spills.
PROBS_MAX_HEADS = 64
_PROBS_CONFIGS = [
    triton.Config({"BLOCK_H": bh, "BLOCK_K": bk}, num_warps=w, num_stages=s)
    for bh, bk, w, s in [(64, 32, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2), (32, 64, 4, 2), (16, 32, 4, 2)]
]


def _prune_probs(configs, named_args, **kwargs):
    """The one head-block width that holds every head: max(16, next power of two of H)."""
    need = max(16, triton.next_power_of_2(kwargs["H"]))
    return [c for c in configs if c.kwargs["BLOCK_H"] == need]


_probs_tuned = triton.autotune(_PROBS_CONFIGS, key=["H", "K", "D"],
                               prune_configs_by={"early_config_prune": _prune_probs})(_probs_kernel)


_fwd_tuned = triton.autotune(_FWD_CONFIGS, key=["H", "K", "D"], prune_configs_by={"early_config_prune": _prune})(
    _fwd_kernel)
_bwd_tuned = triton.autotune(_BWD_CONFIGS, key=["H", "K", "D"], prune_configs_by={"early_config_prune": _prune_bwd},
                             reset_to_zero=["DKV"])(_bwd_kernel)


def _precision(q: Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"


def sparse_mla_fwd_triton(q: Tensor, kv: Tensor, indices: Tensor, *, scale: float,
                          config: dict | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse FP32). `config` ({"BLOCK_H", "BLOCK_K", "num_warps", "num_stages"}) skips autotuning."""
    bsz, seqlen, heads, dim = q.shape
    k = indices.shape[-1]
    q, kv, indices = _rows(q), kv.contiguous(), indices.contiguous()
    out = torch.empty_like(q)  # q's layout
    lse = torch.empty(bsz, seqlen, heads, dtype=torch.float32, device=q.device)
    args = (q, kv, indices, out, lse, seqlen, heads, scale * _LOG2E,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1))
    meta = dict(K=k, D=dim, BLOCK_D=triton.next_power_of_2(dim), PRECISION=_precision(q))
    if config is None:
        grid = lambda m: (bsz * seqlen, triton.cdiv(heads, m["BLOCK_H"]))  # noqa: E731
        _fwd_tuned[grid](*args, **meta)
    else:
        _fwd_kernel[(bsz * seqlen, triton.cdiv(heads, config["BLOCK_H"]))](*args, **meta, **config)
    return out, lse


def sparse_mla_bwd_triton(dout: Tensor, q: Tensor, kv: Tensor, indices: Tensor, out: Tensor, lse: Tensor, *,
                          scale: float, config: dict | None = None) -> tuple[Tensor, Tensor]:
    """(dq, dkv): dkv accumulated in FP32 with atomics, then cast to kv's dtype."""
    bsz, seqlen, heads, dim = q.shape
    k = indices.shape[-1]
    q, kv, indices = _rows(q), kv.contiguous(), indices.contiguous()
    dout, out = _rows(dout), _rows(out)
    lse = lse.float().contiguous()
    dq = torch.empty_like(q)  # q's layout
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    args = (q, kv, indices, out, dout, lse, dq, dkv, seqlen, heads, scale, scale * _LOG2E,
            *q.stride()[:3], *out.stride()[:3], *dout.stride()[:3], *dq.stride()[:3], kv.stride(0), kv.stride(1),
            indices.stride(0), indices.stride(1), lse.stride(0), lse.stride(1))
    meta = dict(K=k, D=dim, BLOCK_D=triton.next_power_of_2(dim), PRECISION=_precision(q))
    if config is None:
        grid = lambda m: (bsz * seqlen, triton.cdiv(heads, m["BLOCK_H"]))  # noqa: E731
        _bwd_tuned[grid](*args, **meta)
    else:
        if _bwd_config_faults(config["BLOCK_H"], config["BLOCK_K"], config.get("num_stages", 3), k):
            raise ValueError(f"sparse_mla_bwd_triton: config {config} faults under Triton 3.6 at K = {k} "
                             f"(BLOCK_H = 64 needs num_stages >= 2 and K >= 2 * BLOCK_K)")
        _bwd_kernel[(bsz * seqlen, triton.cdiv(heads, config["BLOCK_H"]))](*args, **meta, **config)
    return dq, dkv.to(kv.dtype)


def sparse_mla_head_probs_triton(q: Tensor, kv: Tensor, indices: Tensor, *, scale: float,
                                 config: dict | None = None) -> Tensor:
    """[n, K] FP32: sum over heads of softmax_k(q_h . kv[indices_k] * scale) for q [n, H, D] (last dim contiguous,
    H <= PROBS_MAX_HEADS), kv [M, D] and indices [n, K] rows of kv (-1 none): the sparse indexer KL's target
    (ops/sparse_mla.py::sparse_mla_head_probs). Two passes over K (the log-sum-exp, then the probabilities), so
    nothing of size [n, H, K] exists; BF16 products, FP32 sums."""
    n, heads, dim = q.shape
    k = indices.shape[-1]
    if heads > PROBS_MAX_HEADS or (config is not None and config["BLOCK_H"] < heads):
        raise ValueError(f"sparse_mla_head_probs_triton: {heads} heads need BLOCK_H >= H and H <= {PROBS_MAX_HEADS}")
    q, kv, indices = _rows(q), kv.contiguous(), indices.contiguous()
    probs = torch.empty(n, k, dtype=torch.float32, device=q.device)
    args = (q, kv, indices, probs, scale * _LOG2E, q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
            probs.stride(0))
    meta = dict(H=heads, K=k, D=dim, BLOCK_D=triton.next_power_of_2(dim))
    if config is None:
        _probs_tuned[(n,)](*args, **meta)
    else:
        _probs_kernel[(n,)](*args, **meta, **config)
    return probs
