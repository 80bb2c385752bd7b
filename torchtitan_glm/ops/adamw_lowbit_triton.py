"""One Triton kernel for a whole AdamW step over torchao's low-bit optimizer states (AdamW8bit, AdamWFp8).

Why hand-written: torchao's AdamW8bit/AdamWFp8 step each parameter with a torch.compile'd elementwise function, and
the blockwise requantisation of both moments makes inductor emit several passes over the parameter, its gradient
and the states; on the proxy (7.9 B parameters on one H200) that step took 185.7 ms of device time, a quarter of it
launch gaps (docs/performance.md, ninth session), against about 25 ms for one pass at the card's bandwidth.
bitsandbytes' fused 8-bit kernel takes neither FSDP2's DTensors nor torchao's state layout, which the checkpoints
store. This kernel reads each parameter, gradient and moment once and writes them once, in place, in torchao's
layout (codes plus one FP32 scale per block of 256 values; AdamW8bit's 256-entry code map), so checkpoints are the
same whichever implementation wrote them.

The math is torchao's `single_param_adam` for AdamW in FP32: decoupled weight decay, moments by `lerp` (torch's two
branches), bias corrections, then each moment requantised from its FP32 value: the block's absmax (floor 1e-12)
scales it, AdamW8bit picks the nearest code of the map by a branchless binary search (ties upward, as torchao's
`quantize_8bit_with_qmap`), AdamWFp8 divides by absmax/448 and casts to E4M3. Tensors that torchao keeps
unquantised (fewer than 4096 values, or not a multiple of the block) have plain states in the parameter's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["adamw_lowbit_step_", "PLAIN", "DYNAMIC8", "FP8"]

PLAIN, DYNAMIC8, FP8 = 0, 1, 2
_BLOCK = 256  # torchao's block for both AdamW8bit and AdamWFp8
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
def _adamw_kernel(p_ptr, g_ptr, m_ptr, m_scale_ptr, m_qmap_ptr, v_ptr, v_scale_ptr, v_qmap_ptr, numel,
                  lr, lr_wd, w1, w2, bc1, bc2_sqrt, eps,
                  LOWER1: tl.constexpr, LOWER2: tl.constexpr, FORMAT: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < numel
    row_mask = rows * BLOCK < numel
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


def _parts(state: Tensor, fmt: int) -> tuple[Tensor, Tensor, Tensor]:
    """(codes, scale, qmap) of one moment; plain states stand in for all three (the kernel reads only the first)."""
    if fmt == PLAIN:
        return state, state, state
    if fmt == DYNAMIC8:
        return state.codes, state.scale, state.qmap
    return state.codes, state.scale, state.scale


def adamw_lowbit_step_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, fmt: int, lr: float,
                       lr_wd: float, beta1: float, beta2: float, bc1: float, bc2_sqrt: float, eps: float) -> None:
    """One AdamW step of one local (non-DTensor) parameter in place: `p` and `grad` contiguous, the moments
    torchao's OptimState8bit (`fmt` DYNAMIC8), OptimStateFp8 (FP8) or plain tensors (PLAIN). The scalars are FP32
    values computed as torchao computes them (`lr_wd` = lr * weight_decay, `bc1` = 1 - beta1^step,
    `bc2_sqrt` = sqrt(1 - beta2^step))."""
    numel = p.numel()
    if numel == 0:
        return
    m_parts, v_parts = _parts(exp_avg, fmt), _parts(exp_avg_sq, fmt)
    for name, t in (("parameter", p), ("gradient", grad), ("exp_avg", m_parts[0]), ("exp_avg_sq", v_parts[0])):
        if not t.is_contiguous() or t.numel() != numel:
            raise ValueError(f"fused low-bit AdamW: the {name} must be contiguous with {numel} values "
                             f"(got shape {tuple(t.shape)}, stride {t.stride()})")
    if fmt != PLAIN and numel % _BLOCK:
        raise ValueError(f"fused low-bit AdamW: a quantised state needs a multiple of {_BLOCK} values, got {numel}")
    w1, w2 = 1.0 - beta1, 1.0 - beta2
    grid = (triton.cdiv(numel, _ROWS * _BLOCK),)
    _adamw_kernel[grid](p, grad, *m_parts, *v_parts, numel, lr, lr_wd, w1, w2, bc1, bc2_sqrt, eps,
                        LOWER1=abs(w1) < 0.5, LOWER2=abs(w2) < 0.5, FORMAT=fmt, ROWS=_ROWS, BLOCK=_BLOCK,
                        num_warps=4)
