"""One AdamW step of one parameter over torchao's low-bit optimizer states, in place, as a custom op: the torch
reference on CPU, ops/adamw_lowbit_triton.py's single kernel on CUDA (components/lowbit_step.py calls it per
parameter for `optimizer.implementation = "fused"`).

The math is torchao's AdamW (`torchao.optim.adam.single_param_adam`) in FP32: decoupled weight decay, moments by
`torch.lerp`, bias corrections, the parameter updated from the FP32 moments, each moment stored requantised from its
FP32 value. A state is one of three formats:
- DYNAMIC8 (AdamW8bit): uint8 codes into a sorted 256-entry FP32 map (signed for exp_avg, unsigned for exp_avg_sq),
  one FP32 scale (the block's absmax, floor 1e-12) per block of 256 values; the code is the nearest map entry of
  value / scale, a tie going to the upper one;
- FP8 (AdamWFp8): E4M3 codes of value / scale, scale = the block's absmax (floor 1e-12) / 448;
- PLAIN: the moment itself in the parameter's dtype (torchao keeps tensors of fewer than 4096 values, or not a
  multiple of the block, unquantised).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["adamw_lowbit_step_", "state_parts", "PLAIN", "DYNAMIC8", "FP8", "BLOCK", "CODE_SEARCHES"]

PLAIN, DYNAMIC8, FP8 = 0, 1, 2
# how the CUDA kernel finds AdamW8bit's codes (adamw_lowbit_triton.adamw_lowbit_kernel_'s `codes`, by its CODES
# index); here so that scripts can name them without Triton
CODE_SEARCHES = ("search", "direct", "checked", "approx")
BLOCK = 256  # torchao's block for AdamW8bit and AdamWFp8
_E4M3_MAX = 448.0


def _dequant(codes: Tensor, scale: Tensor, qmap: Tensor, fmt: int) -> Tensor:
    if fmt == PLAIN:
        return codes.float()
    values = qmap[codes.long()] if fmt == DYNAMIC8 else codes.float()
    return (values.view(-1, BLOCK) * scale.view(-1, 1)).view(codes.shape)


def _requant_(x: Tensor, codes: Tensor, scale: Tensor, qmap: Tensor, fmt: int) -> None:
    if fmt == PLAIN:
        codes.copy_(x)
        return
    blocks = x.view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1).clamp_min(1e-12)
    new_scale = absmax if fmt == DYNAMIC8 else absmax / _E4M3_MAX
    y = blocks / new_scale.view(-1, 1)
    if fmt == DYNAMIC8:
        below = (torch.searchsorted(qmap, y, right=True) - 1).clamp(0, 255)  # the last entry <= y
        above = (below + 1).clamp(max=255)
        lo, hi = qmap[below], qmap[above]
        codes.copy_(torch.where(y - lo >= (hi - lo) * 0.5, above, below).view(codes.shape).to(torch.uint8))
    else:
        codes.copy_(y.view(codes.shape).to(codes.dtype))
    scale.copy_(new_scale)


@torch.library.custom_op("torchtitan_glm::adamw_lowbit_step",
                         mutates_args=("p", "m_codes", "m_scale", "v_codes", "v_scale"), device_types="cpu")
def _adamw_lowbit_step(p: Tensor, grad: Tensor, m_codes: Tensor, m_scale: Tensor, m_qmap: Tensor, v_codes: Tensor,
                       v_scale: Tensor, v_qmap: Tensor, step: Tensor, found_inf: Tensor | None, fmt: int, lr: float,
                       lr_wd: float, beta1: float, beta2: float, eps: float) -> None:
    if found_inf is not None and bool(found_inf):
        return
    p32, g = p.float(), grad.float()
    m = _dequant(m_codes, m_scale, m_qmap, fmt)
    v = _dequant(v_codes, v_scale, v_qmap, fmt)
    p32 = p32 - lr_wd * p32
    m = torch.lerp(m, g, 1.0 - beta1)
    v = torch.lerp(v, g.square(), 1.0 - beta2)
    _requant_(m, m_codes, m_scale, m_qmap, fmt)
    _requant_(v, v_codes, v_scale, v_qmap, fmt)
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step  # FP32 tensors, as torchao's step computes them
    p.copy_(p32 - lr * (m / bc1) / (v.sqrt() / bc2.sqrt() + eps))


@_adamw_lowbit_step.register_kernel("cuda")
def _adamw_lowbit_step_cuda(p, grad, m_codes, m_scale, m_qmap, v_codes, v_scale, v_qmap, step, found_inf, fmt, lr,
                            lr_wd, beta1, beta2, eps):
    from .adamw_lowbit_triton import adamw_lowbit_kernel_

    if any(type(t) is not torch.Tensor for t in (p, grad, m_codes, v_codes)):  # the kernel reads raw pointers
        raise TypeError("low-bit AdamW step on CUDA: pass plain tensors (a DTensor's local shard, unwrapped)")
    with torch.cuda.device(p.device):
        adamw_lowbit_kernel_(p, grad, m_codes, m_scale, m_qmap, v_codes, v_scale, v_qmap, step, found_inf, fmt=fmt,
                             lr=lr, lr_wd=lr_wd, beta1=beta1, beta2=beta2, eps=eps)


@_adamw_lowbit_step.register_fake
def _adamw_lowbit_step_fake(p, grad, m_codes, m_scale, m_qmap, v_codes, v_scale, v_qmap, step, found_inf, fmt, lr,
                            lr_wd, beta1, beta2, eps):
    return None


def state_parts(state: Tensor, fmt: int) -> tuple[Tensor, Tensor, Tensor]:
    """(codes, scale, qmap) of one torchao moment; an empty tensor where its format has none."""
    if fmt == PLAIN:
        return state, state.new_empty(0), state.new_empty(0, dtype=torch.float32)
    if fmt == DYNAMIC8:
        return state.codes, state.scale, state.qmap
    return state.codes, state.scale, state.scale.new_empty(0)


def adamw_lowbit_step_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor, *, fmt: int,
                       lr: float, lr_wd: float, beta1: float, beta2: float, eps: float,
                       found_inf: Tensor | None = None) -> None:
    """One AdamW step of one local (non-DTensor) parameter in place: `p` and `grad` contiguous, the moments
    torchao's OptimState8bit (`fmt` DYNAMIC8), OptimStateFp8 (FP8) or plain tensors (PLAIN); `step` the FP32 step
    count after this step (a 0-dim tensor on p's device: the bias corrections are computed from it there, so the
    host never reads it); `lr_wd` = lr * weight_decay in FP32. Nothing changes where `found_inf` (a 0-dim FP32 flag
    on p's device) is non-zero."""
    numel = p.numel()
    if numel == 0:
        return
    if fmt == DYNAMIC8 and not (exp_avg.signed and not exp_avg_sq.signed):
        raise ValueError("low-bit AdamW step: exp_avg must be on the signed 8-bit map and exp_avg_sq on the "
                         "unsigned one (as torchao's AdamW8bit makes them)")
    m_parts, v_parts = state_parts(exp_avg, fmt), state_parts(exp_avg_sq, fmt)
    for name, t in (("parameter", p), ("gradient", grad), ("exp_avg", m_parts[0]), ("exp_avg_sq", v_parts[0])):
        if not t.is_contiguous() or t.numel() != numel:
            raise ValueError(f"low-bit AdamW step: the {name} must be contiguous with {numel} values "
                             f"(got shape {tuple(t.shape)}, stride {t.stride()})")
    if fmt != PLAIN and numel % BLOCK:
        raise ValueError(f"low-bit AdamW step: a quantised state needs a multiple of {BLOCK} values, got {numel}")
    for name, t in (("step", step), ("found_inf", found_inf)):
        if t is not None and (t.device != p.device or t.numel() != 1 or t.dtype != torch.float32):
            raise ValueError(f"low-bit AdamW step: {name} must be one FP32 value on {p.device}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    _adamw_lowbit_step(p, grad, *m_parts, *v_parts, step, found_inf, fmt, lr, lr_wd, beta1, beta2, eps)
