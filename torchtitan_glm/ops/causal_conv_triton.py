"""Triton kernels of ops/causal_conv.py (CUDA): the KDA short conv, silu(depthwise causal conv), forward and backward.

Why hand-written: FLA's `causal_conv1d` restarts documents only through host-built `cu_seqlens`/chunk indices (a
host sync where the ids live on the device) and its backward evaluates SiLU' on a pre-activation it first writes to
memory in the input's dtype (BF16). These kernels mask a tap by the token's position in its document, read on the
device, and the backward recomputes the FP32 pre-activation in registers, so nothing but dx and per-program dw
partial sums is written. (Against inductor's kernels for the plain expression the compiled proxy KDA block moved
within the machines' noise on an H100; the eager block went from 66 to 33 ms: docs/performance.md, twenty-second
session.)

A forward program covers BT tokens x BD channels of one row, a backward program a range of such tiles (its dw
partial sum stays in registers); the W shifted reads of each token hit L1/L2. The backward recomputes the
pre-activation of each of the W tokens a tap reaches, W^2 loads per tile where a sliding window would need W: the
loads hit cache, and the kernel is not compute-bound; it has not been profiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["causal_conv_silu_fwd_triton", "causal_conv_silu_bwd_triton"]

_CONFIGS = [
    triton.Config({"BT": bt, "BD": bd}, num_warps=w)
    for bt, bd, w in [(32, 128, 4), (64, 128, 8), (16, 256, 4), (64, 64, 4)]
]


@triton.jit
def _pre_activation(x_row, w, pos_row, o_t, o_d, m_d, T, C, W: tl.constexpr, HAS_POS: tl.constexpr):
    """sum_j m_j(t) x_{t-j} w[:, W-1-j] in FP32 for the tokens o_t (m_j: t - j in t's document and in the row),
    summed in the torch reference's order (tap 0 first)."""
    m_t = (o_t >= 0) & (o_t < T)
    if HAS_POS:
        pos = tl.load(pos_row + o_t, mask=m_t, other=0)
    acc = tl.zeros((o_t.shape[0], o_d.shape[0]), dtype=tl.float32)
    for j in tl.static_range(W):
        m = m_t & (o_t - j >= 0)
        if HAS_POS:
            m = m & (pos >= j)
        xj = tl.load(x_row + (o_t - j)[:, None] * C + o_d[None, :], mask=m[:, None] & m_d[None, :], other=0.0)
        wj = tl.load(w + o_d * W + (W - 1 - j), mask=m_d, other=0.0).to(tl.float32)
        acc += xj.to(tl.float32) * wj[None, :]
    return acc


@triton.jit
def _fwd_kernel(x, w, pos, y, T, C, W: tl.constexpr, HAS_POS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    # tiles on the grid's first axis: CUDA allows 2^31 - 1 there, 65,535 on the others (1M tokens at BT = 16)
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)  # token * C passes 2^31 past T = 256K at 8,192 channels
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    row = i_b.to(tl.int64) * T * C
    pre = _pre_activation(x + row, w, pos + i_b.to(tl.int64) * T, o_t, o_d, m_d, T, C, W, HAS_POS)
    out = pre * tl.sigmoid(pre)
    tl.store(y + row + o_t[:, None] * C + o_d[None, :], out.to(y.dtype.element_ty),
             mask=(o_t < T)[:, None] & m_d[None, :])


@triton.jit
def _bwd_kernel(x, w, pos, dy, dx, dw_part, T, C, NS, TOK: tl.constexpr, W: tl.constexpr, BW: tl.constexpr,
                HAS_POS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """For the tokens [i_s TOK, (i_s + 1) TOK) of a row, in tiles of BT: dx_t = sum_j m_j(t+j) g_{t+j} w[:, W-1-j],
    with g = dy silu'(pre) recomputed for every token the tile's taps reach; and the range's share of
    dw[:, W-1-j] = sum_t m_j(t) g_t x_{t-j}, one [W, BD] partial sum per program."""
    i_d, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    o_w = tl.arange(0, BW)
    row = i_b.to(tl.int64) * T * C
    x_row, pos_row = x + row, pos + i_b.to(tl.int64) * T
    dw_acc = tl.zeros((BW, BD), dtype=tl.float32)
    for it in range(0, TOK // BT):  # the last range's tiles past T are masked out
        o_t = (i_s * TOK + it * BT + tl.arange(0, BT)).to(tl.int64)
        acc = tl.zeros((BT, BD), dtype=tl.float32)
        g0 = tl.zeros((BT, BD), dtype=tl.float32)
        for j in tl.static_range(W):
            s = o_t + j  # the token whose tap j reads x_t
            m_s = s < T
            pre = _pre_activation(x_row, w, pos_row, s, o_d, m_d, T, C, W, HAS_POS)
            dys = tl.load(dy + row + s[:, None] * C + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
            sig = tl.sigmoid(pre)
            g = dys.to(tl.float32) * (sig * (1 + pre * (1 - sig)))
            if j == 0:
                g0 = g
            keep = m_s
            if HAS_POS:
                keep = keep & (tl.load(pos_row + s, mask=m_s, other=0) >= j)
            wj = tl.load(w + o_d * W + (W - 1 - j), mask=m_d, other=0.0).to(tl.float32)
            acc += tl.where(keep[:, None], g, 0.0) * wj[None, :]
        m_t = o_t < T
        tl.store(dx + row + o_t[:, None] * C + o_d[None, :], acc.to(dx.dtype.element_ty),
                 mask=m_t[:, None] & m_d[None, :])
        if HAS_POS:
            pos_t = tl.load(pos_row + o_t, mask=m_t, other=0)
        for j in tl.static_range(W):
            m = m_t & (o_t - j >= 0)
            if HAS_POS:
                m = m & (pos_t >= j)
            xj = tl.load(x_row + (o_t - j)[:, None] * C + o_d[None, :], mask=m[:, None] & m_d[None, :], other=0.0)
            tap = tl.sum(g0 * xj.to(tl.float32), axis=0)
            dw_acc += tl.where(o_w[:, None] == W - 1 - j, tap[None, :], 0.0)
    part = dw_part + ((i_b * NS + i_s).to(tl.int64) * W) * C
    tl.store(part + o_w[:, None] * C + o_d[None, :], dw_acc, mask=(o_w < W)[:, None] & m_d[None, :])


_fwd_tuned = triton.autotune(_CONFIGS, key=["C", "W"])(_fwd_kernel)
_bwd_tuned = triton.autotune(_CONFIGS, key=["C", "W"])(_bwd_kernel)
# The backward's programs each take a range of whole tiles: a power of two, a multiple of every config's BT (a
# compile-time constant, so few distinct values), and at most _MAX_SPLITS ranges per row, so the FP32 dw partial
# sums stay small (32 MiB at 8,192 channels; one per tile was 1 GiB at T = 128K).
_SPLIT_QUANTUM = max(c.kwargs["BT"] for c in _CONFIGS)
_MAX_SPLITS = 256


def _check(x: Tensor, weight: Tensor, pos_in_doc: Tensor | None) -> None:
    """The layout the kernels index: x [B, T, C] contiguous, weight [C, W], positions [B, T] on x's device."""
    if not x.is_contiguous() or x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"causal_conv Triton kernels: x {tuple(x.shape)} (contiguous: {x.is_contiguous()}) and "
                         f"weight {tuple(weight.shape)} are not [B, T, C] contiguous and [C, W]")
    if pos_in_doc is not None and (pos_in_doc.shape != x.shape[:2] or pos_in_doc.device != x.device):
        raise ValueError(f"causal_conv Triton kernels: pos_in_doc {tuple(pos_in_doc.shape)} on "
                         f"{pos_in_doc.device} is not x's [B, T] {tuple(x.shape[:2])} on {x.device}")


def _launch(tuned, kernel, config: dict | None, grid, *args, **meta) -> None:
    if config is None:
        tuned[grid](*args, **meta)
    else:
        kernel[grid(config)](*args, **meta, **config)


def causal_conv_silu_fwd_triton(x: Tensor, weight: Tensor, pos_in_doc: Tensor | None, *,
                                config: dict | None = None) -> Tensor:
    """silu(conv) of x [B, T, C] (contiguous) with weight [C, W]; pos_in_doc [B, T] or None. Output in x's dtype.
    `config` ({"BT", "BD", "num_warps"}) skips autotuning."""
    _check(x, weight, pos_in_doc)
    bsz, seqlen, ch = x.shape
    y = torch.empty_like(x)
    w = weight.contiguous()
    pos = x if pos_in_doc is None else pos_in_doc.contiguous()  # a dummy pointer without positions
    _launch(_fwd_tuned, _fwd_kernel, config, lambda m: (triton.cdiv(seqlen, m["BT"]), triton.cdiv(ch, m["BD"]), bsz),
            x, w, pos, y, seqlen, ch, W=w.shape[1], HAS_POS=pos_in_doc is not None)
    return y


def causal_conv_silu_bwd_triton(dy: Tensor, x: Tensor, weight: Tensor, pos_in_doc: Tensor | None, *,
                                config: dict | None = None) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, dw [C, W] in FP32): per-program dw partial sums, then one sum over them (no atomics, so the
    result does not depend on the schedule)."""
    _check(x, weight, pos_in_doc)
    bsz, seqlen, ch = x.shape
    w = weight.contiguous()
    kernel = w.shape[1]
    dx = torch.empty_like(x)
    pos = x if pos_in_doc is None else pos_in_doc.contiguous()
    tok = max(_SPLIT_QUANTUM, triton.next_power_of_2(triton.cdiv(seqlen, _MAX_SPLITS)))
    splits = triton.cdiv(seqlen, tok)
    if config is not None and tok % config["BT"]:
        raise ValueError(f"causal_conv_silu_bwd_triton: BT = {config['BT']} does not divide the {tok}-token ranges")
    dw_part = torch.empty(bsz * splits, kernel, ch, dtype=torch.float32, device=x.device)
    _launch(_bwd_tuned, _bwd_kernel, config, lambda m: (triton.cdiv(ch, m["BD"]), splits, bsz),
            x, w, pos, dy.contiguous(), dx, dw_part, seqlen, ch, splits, TOK=tok, W=kernel,
            BW=triton.next_power_of_2(kernel), HAS_POS=pos_in_doc is not None)
    return dx, dw_part.sum(0).t().contiguous()
