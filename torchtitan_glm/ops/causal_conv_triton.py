"""Triton kernels of ops/causal_conv.py (CUDA): the KDA short conv, silu(depthwise causal conv), forward and backward.

Why hand-written: FLA's `causal_conv1d` restarts documents only through host-built `cu_seqlens`/chunk indices (a
host sync where the ids live on the device) and its backward evaluates SiLU' on a pre-activation it first writes to
memory in the input's dtype (BF16). These kernels mask a tap by the token's position in its document, read on the
device, and the backward recomputes the FP32 pre-activation in registers, so nothing but dx and per-program dw
partial sums is written. (Against inductor's kernels for the plain expression the compiled proxy KDA block moved
within the machines' noise on an H100; the eager block went from 66 to 33 ms: docs/performance.md, twenty-second
session.)

A forward program covers BT tokens x BD channels of one row. A backward program takes a range of such tiles; per tile
it loads the seven rows x_{t-3} .. x_{t+3} and dy_t .. dy_{t+3} once each, recomputes the pre-activation of t .. t+3
from them, and adds g_t x_{t-i} into four [BT, BD] FP32 dw accumulators, reduced once at the range's end. Four taps
at most (the model's conv has four); wider convs take the torch reference. On an H100 at one proxy conv (T = 8,192,
8,192 channels, BF16) the backward takes 0.48 ms, against 0.90 ms for the previous kernel (W^2 loads per tile, 64-bit
offsets per element, 880 bytes of register spills); FLA's backward kernel took 0.43 ms a call in the stock layer's
profile (`scripts/bench_causal_conv.py`, `scripts/bench_kda.py --profile`; docs/performance.md, twenty-third session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["causal_conv_silu_fwd_triton", "causal_conv_silu_bwd_triton"]

_FWD_CONFIGS = [
    triton.Config({"BT": bt, "BD": bd}, num_warps=w)
    for bt, bd, w in [(32, 128, 4), (64, 128, 8), (16, 256, 4), (64, 64, 4)]
]
# 16 elements of a [BT, BD] tile per thread: the backward keeps about a dozen such tiles live
_BWD_CONFIGS = [
    triton.Config({"BT": bt, "BD": bd}, num_warps=w)
    for bt, bd, w in [(16, 128, 4), (32, 128, 8), (16, 256, 8), (8, 256, 4)]
]
MAX_TAPS = 4  # the backward unrolls up to four taps; wider convs take the torch reference


@triton.jit
def _rows(base, t0, d: tl.constexpr, off, o_r, m_d, T, C):
    """[BT, BD] FP32: rows t0 + d + o_r of the [T, C] block at base (a row's start), zero outside [0, T)."""
    t = t0 + d + o_r
    ok = (t >= 0) & (t < T)
    return tl.load(base + (t0 + d).to(tl.int64) * C + off, mask=ok[:, None] & m_d[None, :], other=0.0).to(tl.float32)


@triton.jit
def _tap_weight(w, o_d, m_d, i: tl.constexpr, W: tl.constexpr):
    """[BD] FP32 weight of tap i, the one reading x_{t-i}: w[:, W-1-i]; zero past the conv's W taps."""
    if i < W:
        return tl.load(w + o_d * W + (W - 1 - i), mask=m_d, other=0.0).to(tl.float32)
    else:
        return tl.zeros(o_d.shape, dtype=tl.float32)


@triton.jit
def _pre4(x0, x1, x2, x3, pos, w0, w1, w2, w3, W: tl.constexpr, HAS_POS: tl.constexpr):
    """The pre-activation of tokens s from x_s .. x_{s-W+1} (tap i masked where pos_s < i; the rows past the W taps
    are not read), in FP32, summed in the torch reference's order (tap 0 first)."""
    acc = tl.zeros(x0.shape, dtype=tl.float32)
    acc += x0 * w0[None, :]
    if W > 1:
        acc += (tl.where((pos >= 1)[:, None], x1, 0.0) if HAS_POS else x1) * w1[None, :]
    if W > 2:
        acc += (tl.where((pos >= 2)[:, None], x2, 0.0) if HAS_POS else x2) * w2[None, :]
    if W > 3:
        acc += (tl.where((pos >= 3)[:, None], x3, 0.0) if HAS_POS else x3) * w3[None, :]
    return acc


@triton.jit
def _silu_grad(pre, dy):
    """dy silu'(pre), FP32."""
    sig = tl.sigmoid(pre)
    return dy * (sig * (1 + pre * (1 - sig)))


@triton.jit
def _tap_grad(dyb, t0, j: tl.constexpr, xs0, xs1, xs2, xs3, pos, w0, w1, w2, w3, off, o_r, m_d, T, C,
              W: tl.constexpr, HAS_POS: tl.constexpr):
    """[BT, BD] g_s = dy_s silu'(pre_s) of the tokens s = t + j (x_s .. x_{s-3} given), zero where tap j of s does
    not reach x_t (pos_s < j): dx_t's term through tap j, before its weight."""
    g = _silu_grad(_pre4(xs0, xs1, xs2, xs3, pos, w0, w1, w2, w3, W, HAS_POS),
                   _rows(dyb, t0, j, off, o_r, m_d, T, C))
    if HAS_POS:
        g = tl.where((pos >= j)[:, None], g, 0.0)
    return g


@triton.jit
def _fwd_kernel(x, w, pos, y, T, C, W: tl.constexpr, HAS_POS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    # tiles on the grid's first axis: CUDA allows 2^31 - 1 there, 65,535 on the others (1M tokens at BT = 16)
    i_t, i_d, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_r = tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    off = o_r[:, None] * C + o_d[None, :]  # int32 within a tile; the tile's start is an int64 scalar
    row = i_b.to(tl.int64) * T * C
    t0 = i_t * BT
    t = t0 + o_r
    pos_t = t
    if HAS_POS:
        pos_t = tl.load(pos + i_b.to(tl.int64) * T + t, mask=t < T, other=0)
    pre = _pre4(_rows(x + row, t0, 0, off, o_r, m_d, T, C), _rows(x + row, t0, -1, off, o_r, m_d, T, C),
                _rows(x + row, t0, -2, off, o_r, m_d, T, C), _rows(x + row, t0, -3, off, o_r, m_d, T, C), pos_t,
                _tap_weight(w, o_d, m_d, 0, W), _tap_weight(w, o_d, m_d, 1, W), _tap_weight(w, o_d, m_d, 2, W),
                _tap_weight(w, o_d, m_d, 3, W), W, HAS_POS)
    out = pre * tl.sigmoid(pre)
    tl.store(y + row + t0.to(tl.int64) * C + off, out.to(y.dtype.element_ty), mask=(t < T)[:, None] & m_d[None, :])


@triton.jit
def _bwd_kernel(x, w, pos, dy, dx, dw_part, T, C, NS, TOK: tl.constexpr, W: tl.constexpr, HAS_POS: tl.constexpr,
                BT: tl.constexpr, BD: tl.constexpr):
    """For the tokens [i_s TOK, (i_s + 1) TOK) of a row, in tiles of BT: dx_t = sum_j m_j(t+j) g_{t+j} w[:, W-1-j]
    with g = dy silu'(pre), the pre-activation of t .. t+3 recomputed from the seven rows x_{t-3} .. x_{t+3}, each
    loaded once; and the range's share of dw[:, W-1-i] = sum_t m_i(t) g_t x_{t-i}, summed over the range in
    registers and written as one [W, BD] partial sum per program."""
    i_d, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_r = tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < C
    off = o_r[:, None] * C + o_d[None, :]
    row = i_b.to(tl.int64) * T * C
    xb, dyb, pb = x + row, dy + row, pos + i_b.to(tl.int64) * T
    w0, w1 = _tap_weight(w, o_d, m_d, 0, W), _tap_weight(w, o_d, m_d, 1, W)
    w2, w3 = _tap_weight(w, o_d, m_d, 2, W), _tap_weight(w, o_d, m_d, 3, W)
    dw0 = tl.zeros((BT, BD), dtype=tl.float32)
    dw1 = tl.zeros((BT, BD), dtype=tl.float32)
    dw2 = tl.zeros((BT, BD), dtype=tl.float32)
    dw3 = tl.zeros((BT, BD), dtype=tl.float32)
    for it in range(0, TOK // BT):  # the last range's tiles past T are masked out
        t0 = i_s * TOK + it * BT
        t = t0 + o_r
        p0, p1, p2, p3 = t, t, t, t
        if HAS_POS:  # p_j: the position in its document of token t + j
            p0 = tl.load(pb + t, mask=t < T, other=0)
            p1 = tl.load(pb + t + 1, mask=t + 1 < T, other=0)
            p2 = tl.load(pb + t + 2, mask=t + 2 < T, other=0)
            p3 = tl.load(pb + t + 3, mask=t + 3 < T, other=0)
        xm3 = _rows(xb, t0, -3, off, o_r, m_d, T, C)
        xm2 = _rows(xb, t0, -2, off, o_r, m_d, T, C)
        xm1 = _rows(xb, t0, -1, off, o_r, m_d, T, C)
        x0 = _rows(xb, t0, 0, off, o_r, m_d, T, C)
        g = _silu_grad(_pre4(x0, xm1, xm2, xm3, p0, w0, w1, w2, w3, W, HAS_POS),
                       _rows(dyb, t0, 0, off, o_r, m_d, T, C))
        acc = g * w0[None, :]
        dw0 += g * x0
        if HAS_POS:
            dw1 += g * tl.where((p0 >= 1)[:, None], xm1, 0.0)
            dw2 += g * tl.where((p0 >= 2)[:, None], xm2, 0.0)
            dw3 += g * tl.where((p0 >= 3)[:, None], xm3, 0.0)
        else:
            dw1 += g * xm1
            dw2 += g * xm2
            dw3 += g * xm3
        if W > 1:
            x1 = _rows(xb, t0, 1, off, o_r, m_d, T, C)
            g = _tap_grad(dyb, t0, 1, x1, x0, xm1, xm2, p1, w0, w1, w2, w3, off, o_r, m_d, T, C, W, HAS_POS)
            acc += g * w1[None, :]
            if W > 2:
                x2 = _rows(xb, t0, 2, off, o_r, m_d, T, C)
                g = _tap_grad(dyb, t0, 2, x2, x1, x0, xm1, p2, w0, w1, w2, w3, off, o_r, m_d, T, C, W, HAS_POS)
                acc += g * w2[None, :]
                if W > 3:
                    x3 = _rows(xb, t0, 3, off, o_r, m_d, T, C)
                    g = _tap_grad(dyb, t0, 3, x3, x2, x1, x0, p3, w0, w1, w2, w3, off, o_r, m_d, T, C, W, HAS_POS)
                    acc += g * w3[None, :]
        tl.store(dx + row + t0.to(tl.int64) * C + off, acc.to(dx.dtype.element_ty),
                 mask=(t < T)[:, None] & m_d[None, :])
    part = dw_part + ((i_b * NS + i_s).to(tl.int64) * W) * C + o_d
    tl.store(part + (W - 1) * C, tl.sum(dw0, axis=0), mask=m_d)
    if W > 1:
        tl.store(part + (W - 2) * C, tl.sum(dw1, axis=0), mask=m_d)
    if W > 2:
        tl.store(part + (W - 3) * C, tl.sum(dw2, axis=0), mask=m_d)
    if W > 3:
        tl.store(part + (W - 4) * C, tl.sum(dw3, axis=0), mask=m_d)


_fwd_tuned = triton.autotune(_FWD_CONFIGS, key=["C", "W"])(_fwd_kernel)
_bwd_tuned = triton.autotune(_BWD_CONFIGS, key=["C", "W"])(_bwd_kernel)
# The backward's programs each take a range of whole tiles: a power of two, a multiple of every config's BT (a
# compile-time constant, so few distinct values), and at most _MAX_SPLITS ranges per row. Fewer, longer ranges pay
# each program's set-up and final reduction over more tiles: at T = 8,192 on an H100, 32 ranges took 0.48 ms, 256
# took 0.76 ms (8 took 0.47 ms); the FP32 dw partial sums are 4 MiB at 8,192 channels.
_SPLIT_QUANTUM = max(c.kwargs["BT"] for c in _BWD_CONFIGS)
_MAX_SPLITS = 32


def _check(x: Tensor, weight: Tensor, pos_in_doc: Tensor | None) -> None:
    """The layout the kernels index: x [B, T, C] contiguous, weight [C, W <= MAX_TAPS], positions [B, T] on x's
    device."""
    if (not x.is_contiguous() or x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]
            or not 1 <= weight.shape[1] <= MAX_TAPS):
        raise ValueError(f"causal_conv Triton kernels: x {tuple(x.shape)} (contiguous: {x.is_contiguous()}) and "
                         f"weight {tuple(weight.shape)} are not [B, T, C] contiguous and [C, W] with W <= {MAX_TAPS}")
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
            HAS_POS=pos_in_doc is not None)
    return dx, dw_part.sum(0).t().contiguous()
