"""Grouped GEMM over token groups sorted by expert, as a torch.library custom op.

torch._grouped_mm runs fp32/bf16 on CPU and bf16 on CUDA, but its fake (meta) kernel accepts only bf16, so fp32
graphs could not compile; behind our own op with its own fake and autograd formulas the MoE block compiles in any
dtype, and the implementation picks torch._grouped_mm where it runs and a per-expert loop elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _native_ok(a: Tensor, b: Tensor) -> bool:
    """torch._grouped_mm needs a supported dtype and 16-byte aligned strides (all real GLM shapes have them)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if a.device.type == "cuda":
        dtype_ok = a.dtype == torch.bfloat16
    else:
        dtype_ok = a.device.type == "cpu" and a.dtype in (torch.float32, torch.bfloat16)
    aligned = all((s * t.element_size()) % 16 == 0 for t in (a, b) for s in t.stride() if s != 1)
    return dtype_ok and aligned


@torch.library.custom_op("torchtitan_glm::grouped_mm", mutates_args=())
def _grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """x [N, K] (rows grouped), w [G, K, M], offs [G] int32 cumulative row ends -> [N, M]."""
    if _native_ok(x, w):
        return torch._grouped_mm(x, w, offs=offs)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    begin = 0
    for g, end in enumerate(offs.tolist()):
        if end > begin:
            out[begin:end] = x[begin:end] @ w[g]
        begin = end
    return out


@_grouped_mm.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("torchtitan_glm::grouped_mm_wgrad", mutates_args=())
def _grouped_mm_wgrad(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    """dW[g] = x_g^T dy_g for each group: [G, K, M]."""
    if _native_ok(x.t(), dy):
        return torch._grouped_mm(x.t(), dy, offs=offs)
    out = x.new_zeros(offs.shape[0], x.shape[1], dy.shape[1])
    begin = 0
    for g, end in enumerate(offs.tolist()):
        if end > begin:
            out[g] = x[begin:end].t() @ dy[begin:end]
        begin = end
    return out


@_grouped_mm_wgrad.register_fake
def _(x: Tensor, dy: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy: Tensor):
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = _grouped_mm(dy, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    dw = None
    if ctx.needs_input_grad[1]:
        if w.transpose(-2, -1).is_contiguous():
            # w is a transposed view of a [G, M, K] parameter (the experts' nn.Linear layout): form the gradient in
            # that layout, so it reaches AccumulateGrad contiguous instead of being copied there (one full copy of
            # every expert weight per step otherwise).
            dw = _grouped_mm_wgrad(dy, x, offs).transpose(-2, -1)
        else:
            dw = _grouped_mm_wgrad(x, dy, offs)
    return dx, dw, None


_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """x [N, K] rows sorted by group, w [G, K, M], offs [G] int32 cumulative row ends -> [N, M]."""
    return _grouped_mm(x, w, offs)
