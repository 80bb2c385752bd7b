"""The Triton kernel of ops/adamw_lowbit.py (CUDA): a whole AdamW step of one parameter over torchao's low-bit
optimizer states in one pass.

Why hand-written: torchao's AdamW8bit/AdamWFp8 step each parameter with a torch.compile'd elementwise function, and
the blockwise requantisation of both moments makes inductor emit several passes over the parameter, its gradient
and the states; on the proxy (7.95e9 parameters on one H200) that step took 185.7 ms of device time, a quarter of
it launch gaps (docs/performance.md, ninth session), where one pass at the card's bandwidth is about 30 ms.
bitsandbytes' fused 8-bit kernel takes neither FSDP2's DTensors nor torchao's state layout, which the checkpoints
store. This kernel reads each parameter, gradient and moment once and writes them once, in place, in torchao's
layout, so checkpoints are the same whichever implementation wrote them. AdamW8bit's nearest code is found by a
branchless binary search over the 256-entry map (8 comparisons), then rounded to the nearer neighbour.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .adamw_lowbit import BLOCK

__all__ = ["adamw_lowbit_kernel_"]

_ROWS = 8  # blocks per program: 2048 values, 8 KiB of FP32 parameter


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
def _requant(x, codes_ptr, scale_ptr, qmap_ptr, offs, rows, mask, row_mask, FORMAT: tl.constexpr):
    if FORMAT == 0:
        tl.store(codes_ptr + offs, x.to(codes_ptr.dtype.element_ty), mask=mask)
    elif FORMAT == 1:
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
        y = x / scale[:, None]
        codes = tl.where(y >= tl.load(qmap_ptr + 128), 128, 0)
        codes += tl.where(y >= tl.load(qmap_ptr + codes + 64), 64, 0)
        codes += tl.where(y >= tl.load(qmap_ptr + codes + 32), 32, 0)
        codes += tl.where(y >= tl.load(qmap_ptr + codes + 16), 16, 0)
        codes += tl.where(y >= tl.load(qmap_ptr + codes + 8), 8, 0)
        codes += tl.where(y >= tl.load(qmap_ptr + codes + 4), 4, 0)
        codes += tl.where(y >= tl.load(qmap_ptr + codes + 2), 2, 0)
        codes += tl.where(y >= tl.load(qmap_ptr + codes + 1), 1, 0)
        up = tl.minimum(codes + 1, 255)
        down_val = tl.load(qmap_ptr + codes)
        up_val = tl.load(qmap_ptr + up)
        codes = tl.where(y - down_val >= (up_val - down_val) * 0.5, up, codes)
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
    _requant(m, m_ptr, m_scale_ptr, m_qmap_ptr, offs, rows, mask, row_mask, FORMAT)
    _requant(v, v_ptr, v_scale_ptr, v_qmap_ptr, offs, rows, mask, row_mask, FORMAT)
    denom = tl.sqrt(v) / bc2_sqrt + eps
    p = p - lr * (m / bc1) / denom
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)


def adamw_lowbit_kernel_(p: Tensor, grad: Tensor, m_codes: Tensor, m_scale: Tensor, m_qmap: Tensor, v_codes: Tensor,
                         v_scale: Tensor, v_qmap: Tensor, step: Tensor, found_inf: Tensor | None, *, fmt: int,
                         lr: float, lr_wd: float, beta1: float, beta2: float, eps: float) -> None:
    """ops/adamw_lowbit.py's step on CUDA (its arguments, checked there); a format's unused tensors are empty. The
    bias corrections 1 - beta^step come from the device's step count as exp2(step * log2(beta)) (within an FP32
    ulp or two of torchao's host-side pow)."""
    numel = p.numel()
    w1, w2 = 1.0 - beta1, 1.0 - beta2
    # a format's missing scale or map: the codes stand in (the kernel never reads them; Triton wants a pointer)
    m_scale, m_qmap = (t if t.numel() else m_codes for t in (m_scale, m_qmap))
    v_scale, v_qmap = (t if t.numel() else v_codes for t in (v_scale, v_qmap))
    log2_b1, log2_b2 = (math.log2(b) if b > 0 else -math.inf for b in (beta1, beta2))
    grid = (triton.cdiv(numel, _ROWS * BLOCK),)
    _adamw_kernel[grid](p, grad, m_codes, m_scale, m_qmap, v_codes, v_scale, v_qmap, step,
                        step if found_inf is None else found_inf, numel, lr, lr_wd, w1, w2, log2_b1, log2_b2, eps,
                        LOWER1=abs(w1) < 0.5, LOWER2=abs(w2) < 0.5, FORMAT=fmt, HAS_SKIP=found_inf is not None,
                        ROWS=_ROWS, BLOCK=BLOCK, num_warps=4)
