"""The Triton kernel of ops/adamw_lowbit.py (CUDA): a whole AdamW step of one parameter over torchao's low-bit
optimizer states in one pass.

Why hand-written: torchao's AdamW8bit/AdamWFp8 step each parameter with a torch.compile'd elementwise function, and
the blockwise requantisation of both moments makes inductor emit several passes over the parameter, its gradient
and the states; on the proxy (7.95e9 parameters on one H200) that step took 185.7 ms of device time, a quarter of
it launch gaps (docs/performance.md, ninth session), where one pass at the card's bandwidth is about 30 ms.
bitsandbytes' fused 8-bit kernel takes neither FSDP2's DTensors nor torchao's state layout, which the checkpoints
store. This kernel reads each parameter, gradient and moment once and writes them once, in place, in torchao's
layout, so checkpoints are the same whichever implementation wrote them. AdamW8bit's nearest code is computed
from the map's structure and settled among the three map entries around it (_direct_code, _neighbour_code), where
torchao's binary search over the 256-entry map is 10 dependent gathers per value and moment: on an H200, over the
proxy's 7.95e9 parameters, 98.5 ms against 108-129 ms with the search and 32-39 ms for AdamWFp8's step, which
moves the same bytes and searches nothing (docs/performance.md, sixteenth session).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .adamw_lowbit import BLOCK, CODE_SEARCHES, DYNAMIC8

__all__ = ["CODE_SEARCHES", "adamw_lowbit_kernel_"]

# Launch shapes (256-value blocks per program, warps) by state format, as measured on an H200 over the proxy's
# 7.95e9 parameters (scripts/bench_optim.py; docs/performance.md, sixteenth session): AdamW8bit's codes at 1/2, the
# fastest of its kernel-alone rows ("checked" 98.5 ms; the binary search 128.6 ms at 8/4; more values per thread
# took more registers: 241 at 8/4 with "direct"); the formats with no search at 8/4 (AdamWFp8: 32-39 ms). The
# default codes, "approx", beat "checked" at 1/2 by 21% on an H100 over 2e9 parameters (20.1 against 25.5 ms; its
# 1/4 and 2/4 shapes were slower: seventeenth session).
_SHAPE = {DYNAMIC8: (1, 2)}
_SHAPE_OTHERS = (8, 4)


@triton.jit
def _lerp(start, end, weight, LOWER: tl.constexpr):
    # torch.lerp with a scalar weight: start + w (end - start) for |w| < 0.5, else end - (end - start)(1 - w)
    if LOWER:
        return start + weight * (end - start)
    else:
        return end - (end - start) * (1.0 - weight)


@triton.jit
def _dequant(codes_ptr, scale_ptr, qmap_ptr, offs, rows, mask, row_mask, FORMAT: tl.constexpr):
    if FORMAT == 0:
        return tl.load(codes_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    elif FORMAT == 1:
        codes = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
        return tl.load(qmap_ptr + codes, mask=mask, other=0.0) * scale[:, None]
    else:
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
        return tl.load(codes_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale[:, None]


@triton.jit
def _binary_search_code(y, qmap_ptr, mask):
    """The nearest code of y by torchao's rule: the last entry <= y by a branchless binary search over the sorted
    map (8 gathers), then the upper neighbour where y is at least halfway to it (2 more). Masked-off lanes issue no
    loads."""
    codes = tl.where(y >= tl.load(qmap_ptr + 128), 128, 0)
    codes += tl.where(y >= tl.load(qmap_ptr + codes + 64, mask=mask, other=0.0), 64, 0)
    codes += tl.where(y >= tl.load(qmap_ptr + codes + 32, mask=mask, other=0.0), 32, 0)
    codes += tl.where(y >= tl.load(qmap_ptr + codes + 16, mask=mask, other=0.0), 16, 0)
    codes += tl.where(y >= tl.load(qmap_ptr + codes + 8, mask=mask, other=0.0), 8, 0)
    codes += tl.where(y >= tl.load(qmap_ptr + codes + 4, mask=mask, other=0.0), 4, 0)
    codes += tl.where(y >= tl.load(qmap_ptr + codes + 2, mask=mask, other=0.0), 2, 0)
    codes += tl.where(y >= tl.load(qmap_ptr + codes + 1, mask=mask, other=0.0), 1, 0)
    up = tl.minimum(codes + 1, 255)
    down_val = tl.load(qmap_ptr + codes, mask=mask, other=0.0)
    up_val = tl.load(qmap_ptr + up, mask=mask, other=0.0)
    return tl.where(y - down_val >= (up_val - down_val) * 0.5, up, codes)


@triton.jit
def _direct_code(y, qmap_ptr, mask, SIGNED: tl.constexpr, CHECK_ALL: tl.constexpr):
    """The same code computed from the map's structure, with no gathers for all but a few lanes.

    torchao's dynamic map (create_dynamic_map, default arguments): decade i = 0..6 holds n = 2^i (signed) or 2^(i+1)
    (unsigned) values 10^(i-6) (0.1 + 0.9 (j + 0.5) / n), j < n, evenly spaced, so the nearest value of a = |y| in
    its decade is j = floor(pos + 1/2) with pos = ((a / 10^(i-6) - 0.1) / 0.9) n - 1/2; a past either end of its
    decade (pos < 0 or > n - 1) goes to that end or to the neighbouring value (the previous decade's top, zero
    below decade 0; the next decade's bottom, 1.0 above decade 6) by their midpoint. Positive values have codes
    128 + k (signed; 127 is zero) or 1 + k (unsigned; 0 is zero) for the k-th positive value, 1.0 is 255, and the
    signed map's negatives mirror the positives at 126 - k (no -1.0: -1 takes the most negative, code 0). Computed
    in FP32 (the GPU's approximate log2/exp2 included) this lands on the right value wherever a is not within 1e-3
    of a spacing (or 1e-5 relative) of a midpoint; the position's rounding error is under 2e-4 spacings. Those few
    lanes (every lane with CHECK_ALL) are settled by the map's entries around the code (_neighbour_code), which
    also settles exact ties as torchao does; NaN takes code 0, as the binary search gives it."""
    U: tl.constexpr = 0 if SIGNED else 1
    a = tl.abs(y)
    i = tl.floor(tl.log2(tl.maximum(a, 1e-30)) * 0.30102999566398120) + 7.0  # decade of a
    i = tl.minimum(tl.maximum(i, 0.0), 6.0)
    n = tl.exp2(i + U)
    unit = tl.exp2((i - 6.0) * 3.3219280948873623)  # 10^(i-6)
    pos = (a / unit - 0.1) / 0.9 * n - 0.5
    jr = tl.floor(pos + 0.5)
    frac = pos + 0.5 - jr
    safe = tl.minimum(frac, 1.0 - frac) >= 1e-3
    start = n - tl.exp2(U * 1.0)  # positive values before decade i
    # below the decade's first value: that value or the previous one (the top of decade i-1, or zero)
    first = unit * (0.1 + 0.45 / n)
    prev = tl.where(i > 0.0, unit * 0.1 * (1.0 - 0.9 / n), 0.0)  # top of decade i-1: 10^(i-7)(1 - 0.45 / (n/2))
    mid_lo = (prev + first) * 0.5
    # above its last value: that value or the next one (decade i+1's first, or 1.0 above decade 6)
    last = unit * (1.0 - 0.45 / n)
    nxt = tl.where(i < 6.0, unit * 10.0 * (0.1 + 0.225 / n), 1.0)
    mid_hi = (last + nxt) * 0.5
    # the neighbours past either end are not one spacing away (the previous decade's top at pos -0.6, the next
    # decade's first at n + 2, 1.0 at n - 1/2 for decade 6): outside [0, n - 1] the midpoint decides
    low, high = pos < 0.0, pos > n - 1.0
    k = start + jr
    k = tl.where(low, start - 1.0 + (a >= mid_lo).to(tl.float32), k)
    k = tl.where(high, start + n - 1.0 + (a >= mid_hi).to(tl.float32), k)
    edge = tl.where(low, mid_lo, mid_hi)
    safe = tl.where(low | high, tl.abs(a - edge) >= 1e-5 * a, safe)
    k = tl.where(a < 1e-7, -1.0, k)  # zero (decade 0 starts at 3.25e-7)
    safe = safe | (a < 1e-7)
    if SIGNED:
        code = tl.where(y < 0.0, 126.0 - tl.minimum(k, 126.0), 128.0 + k)
    else:
        code = 1.0 + k
    code = tl.where(a == a, tl.minimum(tl.maximum(code, 0.0), 255.0), 0.0).to(tl.int32)
    if CHECK_ALL:
        return _neighbour_code(y, code, qmap_ptr, mask)
    else:
        checked = _neighbour_code(y, code, qmap_ptr, mask & (safe == 0) & (a == a))
        return tl.where(safe | (a != a), code, checked)


@triton.jit
def _approx_code(y, SIGNED: tl.constexpr):
    """A code within one of the nearest, for _neighbour_code to settle on every lane ("approx"): _direct_code's
    decade and position with none of its edge cases (a position past either end of its decade is clamped to that
    end, which is within one of the right code; the neighbours settle midpoints and ties) and no division. NaN
    takes 0."""
    U: tl.constexpr = 0 if SIGNED else 1
    a = tl.abs(y)
    i = tl.floor(tl.log2(tl.maximum(a, 1e-30)) * 0.30102999566398120) + 7.0  # decade of a
    i = tl.minimum(tl.maximum(i, 0.0), 6.0)
    n = tl.floor(tl.exp2(i + U) + 0.5)  # exactly 2^(i+U), whatever the approximate exp2 gives
    # floor(pos + 1/2), pos = (a / 10^(i-6) - 0.1) / 0.9 n - 1/2
    j = tl.floor((a * tl.exp2((6.0 - i) * 3.3219280948873623) - 0.1) * (n * 1.1111111111111112))
    k = n - (1.0 + U) + tl.minimum(tl.maximum(j, 0.0), n - 1.0)  # 2^U = 1 + U positive values before decade 0
    k = tl.where(a < 1e-7, -1.0, k)  # zero
    if SIGNED:
        code = tl.where(y < 0.0, 126.0 - tl.minimum(k, 126.0), 128.0 + k)
    else:
        code = 1.0 + k
    return tl.where(a == a, tl.minimum(tl.maximum(code, 0.0), 255.0), 0.0).to(tl.int32)


@triton.jit
def _neighbour_code(y, code, qmap_ptr, mask):
    """torchao's rule (the last entry <= y, or the next one where y is at least halfway to it) among the entries
    code - 1, code, code + 1: exact wherever the nearest code is within one of `code`, so wherever y lies between
    entries code - 1 and code + 1. Three independent gathers instead of the binary search's ten dependent ones."""
    lo, hi = tl.maximum(code - 1, 0), tl.minimum(code + 1, 255)
    at_lo = tl.load(qmap_ptr + lo, mask=mask, other=0.0)
    at = tl.load(qmap_ptr + code, mask=mask, other=0.0)
    at_hi = tl.load(qmap_ptr + hi, mask=mask, other=0.0)
    above = y >= at
    down, up = tl.where(above, code, lo), tl.where(above, hi, code)
    down_val, up_val = tl.where(above, at, at_lo), tl.where(above, at_hi, at)
    return tl.where(y - down_val >= (up_val - down_val) * 0.5, up, down)


@triton.jit
def _requant(x, codes_ptr, scale_ptr, qmap_ptr, offs, rows, mask, row_mask, FORMAT: tl.constexpr,
             SIGNED: tl.constexpr, CODES: tl.constexpr):
    if FORMAT == 0:
        tl.store(codes_ptr + offs, x.to(codes_ptr.dtype.element_ty), mask=mask)
    elif FORMAT == 1:
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
        y = x / scale[:, None]
        if CODES == 0:
            codes = _binary_search_code(y, qmap_ptr, mask)
        elif CODES == 3:
            codes = _neighbour_code(y, _approx_code(y, SIGNED), qmap_ptr, mask)
        else:
            codes = _direct_code(y, qmap_ptr, mask, SIGNED, CODES == 2)
        tl.store(codes_ptr + offs, codes.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + rows, scale, mask=row_mask)
    else:
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
        tl.store(codes_ptr + offs, (x / scale[:, None]).to(codes_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + rows, scale, mask=row_mask)


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, m_scale_ptr, m_qmap_ptr, v_ptr, v_scale_ptr, v_qmap_ptr, step_ptr, skip_ptr,
                  numel, lr, lr_wd, w1, w2, log2_beta1, log2_beta2, eps,
                  LOWER1: tl.constexpr, LOWER2: tl.constexpr, FORMAT: tl.constexpr, HAS_SKIP: tl.constexpr,
                  CODES: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # FORMAT: ops/adamw_lowbit.py's PLAIN 0, DYNAMIC8 1, FP8 2
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < numel
    row_mask = rows * BLOCK < numel
    if HAS_SKIP:  # found_inf: every store masked off (the loads still run; a skipped step is rare)
        skip = tl.load(skip_ptr)
        mask = mask & ((tl.zeros([ROWS, BLOCK], tl.float32) + skip) == 0)
        row_mask = row_mask & ((tl.zeros([ROWS], tl.float32) + skip) == 0)
    step = tl.load(step_ptr)
    bc1 = 1.0 - tl.exp2(step * log2_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = _dequant(m_ptr, m_scale_ptr, m_qmap_ptr, offs, rows, mask, row_mask, FORMAT)
    v = _dequant(v_ptr, v_scale_ptr, v_qmap_ptr, offs, rows, mask, row_mask, FORMAT)
    p = p - lr_wd * p
    m = _lerp(m, g, w1, LOWER1)
    v = _lerp(v, g * g, w2, LOWER2)
    _requant(m, m_ptr, m_scale_ptr, m_qmap_ptr, offs, rows, mask, row_mask, FORMAT, True, CODES)  # signed map
    _requant(v, v_ptr, v_scale_ptr, v_qmap_ptr, offs, rows, mask, row_mask, FORMAT, False, CODES)  # unsigned
    denom = tl.sqrt(v) / bc2_sqrt + eps
    p = p - lr * (m / bc1) / denom
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


def adamw_lowbit_kernel_(p: Tensor, grad: Tensor, m_codes: Tensor, m_scale: Tensor, m_qmap: Tensor, v_codes: Tensor,
                         v_scale: Tensor, v_qmap: Tensor, step: Tensor, found_inf: Tensor | None, *, fmt: int,
                         lr: float, lr_wd: float, beta1: float, beta2: float, eps: float,
                         codes: str = "approx", rows: int | None = None, num_warps: int | None = None):
    """ops/adamw_lowbit.py's step on CUDA (its arguments, checked there; AdamW8bit's exp_avg on the signed map,
    exp_avg_sq on the unsigned one, as torchao makes them); a format's unused tensors are empty. The bias
    corrections 1 - beta^step come from the device's step count as exp2(step * log2(beta)) (within an FP32 ulp or
    two of torchao's host-side pow). `codes` picks how AdamW8bit's codes are found, all to the same codes (timed
    against each other by scripts/bench_optim.py): "direct" from the map's structure, checked against the map
    where that is uncertain; "checked": the same code settled against the map on every lane; "approx" (the
    default, the fastest measured): a cheaper approximate code settled the same way; "search": the binary
    search. rows (256-value blocks per program) and num_warps: the launch shape (default:
    the format's measured one), for the same timing. Returns Triton's compiled kernel (its n_regs and n_spills are
    in the benchmark's table)."""
    if codes not in CODE_SEARCHES:
        raise ValueError(f"codes={codes!r}: one of {CODE_SEARCHES}")
    default_rows, default_warps = _SHAPE.get(fmt, _SHAPE_OTHERS)
    rows, num_warps = rows or default_rows, num_warps or default_warps
    numel = p.numel()
    w1, w2 = 1.0 - beta1, 1.0 - beta2
    # a format's missing scale or map: the codes stand in (the kernel never reads them; Triton wants a pointer)
    m_scale, m_qmap = (t if t.numel() else m_codes for t in (m_scale, m_qmap))
    v_scale, v_qmap = (t if t.numel() else v_codes for t in (v_scale, v_qmap))
    log2_b1, log2_b2 = (math.log2(b) if b > 0 else -math.inf for b in (beta1, beta2))
    grid = (triton.cdiv(numel, rows * BLOCK),)
    return _adamw_kernel[grid](p, grad, m_codes, m_scale, m_qmap, v_codes, v_scale, v_qmap, step,
                               step if found_inf is None else found_inf, numel, lr, lr_wd, w1, w2, log2_b1, log2_b2,
                               eps, LOWER1=abs(w1) < 0.5, LOWER2=abs(w2) < 0.5, FORMAT=fmt,
                               HAS_SKIP=found_inf is not None, CODES=CODE_SEARCHES.index(codes), ROWS=rows,
                               BLOCK=BLOCK, num_warps=num_warps)
