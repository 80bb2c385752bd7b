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


# ------------------------------------------------------------------------------------------ FP8 rowwise
# torchao's FP8 grouped GEMM (prototype.moe_training) quantises each operand along its contraction dim with
# power-of-two scales: forward A per row and B per (group, output column); dgrad dY per row and B per (group, input
# row); wgrad dY and A per (group, column) over the group's rows. It needs CUDA (Triton kernels and
# torch._scaled_grouped_mm); elsewhere the same quantisation is emulated: quantise, dequantise, grouped GEMM in the
# input dtype (as torchao's `emulate` does for Linear), so CPU CI trains the routed experts through the same
# rounding. Group sizes must be multiples of FP8_GROUP_ALIGN (GroupedExperts pads them).
# The FP8 path sits behind `grouped_mm`, not inside the `grouped_mm` custom op: torchao's FP8 grouped GEMM is an
# autograd.Function over its own custom ops (the Triton casts) and torch._scaled_grouped_mm, which Dynamo traces
# whole, so the MoE block still compiles with fullgraph=True (tests/gpu/test_float8_cuda.py reads the FP8 GEMMs
# from inductor's code). An op of ours around it would have to re-implement its backward, which torchao keeps
# private.

FP8_GROUP_ALIGN = 16


def _fp8_round_trip(x: Tensor, amax: Tensor) -> Tensor:
    """x quantised to E4M3 with torchao's power-of-two scale for `amax` (broadcast to x), dequantised."""
    from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

    scale = amax_to_scale(amax.float(), torch.float8_e4m3fn, round_scales_to_power_of_2=True)
    return (to_fp8_saturated(x.float() * scale, torch.float8_e4m3fn).float() / scale).to(x.dtype)


def _group_of_rows(offs: Tensor, rows: int) -> Tensor:
    """[rows] group index of each row (G for rows past the last group); static shape."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


def _per_group_colwise(x: Tensor, offs: Tensor) -> Tensor:
    """x [N, C] quantised per (group, column) over the group's rows (wgrad operands)."""
    group = _group_of_rows(offs, x.shape[0])
    amax = x.new_zeros(offs.shape[0] + 1, x.shape[1], dtype=torch.float32).scatter_reduce(
        0, group.unsqueeze(-1).expand(x.shape), x.abs().float(), "amax")
    return _fp8_round_trip(x, amax[group])


def _rowwise(x: Tensor, dim: int = -1) -> Tensor:
    return _fp8_round_trip(x, x.abs().amax(dim=dim, keepdim=True))


class _EmulatedFp8GroupedMM(torch.autograd.Function):
    """The rounding of torchao's FP8 rowwise grouped GEMM, computed in the input dtype (see above)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        return _grouped_mm(_rowwise(x), _rowwise(w, dim=-2), offs)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _grouped_mm(_rowwise(dy), _rowwise(w, dim=-1).transpose(-2, -1), offs)
        dw = _grouped_mm_wgrad(_per_group_colwise(dy, offs), _per_group_colwise(x, offs), offs).transpose(-2, -1)
        return dx, dw, None


def grouped_mm(x: Tensor, w: Tensor, offs: Tensor, *, fp8: bool = False) -> Tensor:
    """x [N, K] rows sorted by group, w [G, K, M], offs [G] int32 cumulative row ends -> [N, M].

    fp8: FP8 rowwise (E4M3, power-of-two scales) for the forward and both backward GEMMs; groups must be multiples
    of FP8_GROUP_ALIGN rows and w a transposed view of a [G, M, K] weight. On CUDA with BF16 inputs this is
    torchao's FP8 grouped GEMM; elsewhere its emulation."""
    if not fp8:
        return _grouped_mm(x, w, offs)
    if x.is_cuda and x.dtype == torch.bfloat16:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

        return _to_fp8_rowwise_then_scaled_grouped_mm(x, w, offs, out_dtype=x.dtype,
                                                      pad_token_groups_for_grouped_mm=False)
    return _EmulatedFp8GroupedMM.apply(x, w, offs)


def pad_groups(x: Tensor, counts: Tensor, *, align: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of x sorted by group (counts [G]) placed so every group starts at a multiple of `align` rows.

    Returns (x_padded [N + G * (align - 1), rounded up to a multiple of align] with zero padding rows, padded offs [G]
    int32, index [N] of each original row in x_padded); the row count is a multiple of align too, because the FP8
    wgrad GEMM reads the transposed activations with a row stride of that many bytes (CUDA needs 16-byte strides).
    Static shapes: no host sync, no recompile when the routing changes."""
    padded = (counts + align - 1) // align * align
    offs = counts.cumsum(0)
    group = _group_of_rows(offs, x.shape[0])
    shift = (padded.cumsum(0) - padded) - (offs - counts)  # padded start - unpadded start, per group
    index = torch.arange(x.shape[0], device=x.device) + shift[group]
    rows = -(-(x.shape[0] + counts.shape[0] * (align - 1)) // align) * align
    out = x.new_zeros(rows, x.shape[1]).index_copy(0, index, x)
    return out, padded.cumsum(0).to(torch.int32), index
