"""The KDA short conv as a custom op: silu(depthwise causal conv) in FP32, restarted at document boundaries.

    causal_conv_silu(x [B, T, C], weight [C, W], pos_in_doc [B, T] | None, halo [B, P, W-1, C] | None) -> [B, T, C]

Tap W-1 of the weight multiplies x_t, tap W-1-j x_{t-j}; a tap that reaches into the previous document (pos_in_doc
< j) reads zero. The custom ops `causal_conv_silu_fwd` / `causal_conv_silu_bwd` compile as opaque nodes that keep
only the inputs for the backward (x in its own dtype, BF16 in training), which recomputes the FP32 pre-activation.
CPU, and CUDA with a halo (context parallelism, decode) or more than four taps: the torch reference below. CUDA
without a halo: Triton kernels (ops/causal_conv_triton.py). Compiled with a halo: the reference as a plain expression
in a checkpointed region, which inductor fuses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

__all__ = ["causal_conv_silu", "causal_conv_silu_reference", "causal_conv_silu_reference_bwd"]

def _acc(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # FP32, or FP64 for gradcheck


def _shifted(xf: Tensor, halo: Tensor | None, j: int, kernel: int) -> Tensor:
    """x_{t-j} for every t of xf [B, T, C] (FP32): zeros before the row starts, or with halo [B, P, W-1, C] the
    tokens before each of the P slots the local T holds."""
    if halo is None:
        return F.pad(xf[:, :-j], (0, 0, j, 0)) if j < xf.shape[1] else torch.zeros_like(xf)
    bsz, seqlen, ch = xf.shape
    slots = halo.shape[1]
    padded = torch.cat([halo.to(xf.dtype), xf.reshape(bsz, slots, seqlen // slots, ch)], dim=2)
    return padded[:, :, kernel - 1 - j:padded.shape[2] - j].reshape(xf.shape)


def _unshifted(a: Tensor, j: int, slots: int) -> Tensor:
    """The adjoint of _shifted on the local tokens: a_{t+j} within each slot, zeros past its end."""
    bsz, seqlen, ch = a.shape
    a = a.reshape(bsz, slots, seqlen // slots, ch)
    return F.pad(a[:, :, j:], (0, 0, 0, min(j, a.shape[2]))).reshape(bsz, seqlen, ch)


def _masks(pos_in_doc: Tensor | None, kernel: int, dtype: torch.dtype) -> list[Tensor | None]:
    """Per tap j, 1 where x_{t-j} is in t's document (pos_in_doc >= j); None: every tap is (one document)."""
    if pos_in_doc is None:
        return [None] * kernel
    return [None] + [(pos_in_doc >= j).unsqueeze(-1).to(dtype) for j in range(1, kernel)]


def _pre_activation(xf: Tensor, w: Tensor, halo: Tensor | None,
                    masks: list[Tensor | None]) -> Tensor:
    """sum_j m_j x_{t-j} w[:, W-1-j] in FP32, in the order the forward has always used (bit-identical)."""
    kernel = w.shape[1]
    out = xf * w[:, -1]
    for j in range(1, kernel):
        shifted = _shifted(xf, halo, j, kernel)
        if masks[j] is not None:
            shifted = shifted * masks[j]
        out = out + shifted * w[:, -1 - j]
    return out


def causal_conv_silu_reference(x: Tensor, weight: Tensor, pos_in_doc: Tensor | None,
                               halo: Tensor | None) -> Tensor:
    """The forward expression: silu(pre-activation) in FP32, cast to x's dtype."""
    xf = x.to(_acc(x))
    pre = _pre_activation(xf, weight.to(_acc(weight)), halo, _masks(pos_in_doc, weight.shape[1], xf.dtype))
    return F.silu(pre).to(x.dtype)


def causal_conv_silu_reference_bwd(grad_out: Tensor, x: Tensor, weight: Tensor, pos_in_doc: Tensor | None,
                                   halo: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dx, dw in weight's dtype, dhalo or None), recomputing the pre-activation per channel chunk; with
    g = dy silu'(pre): dw[:, W-1-j] = sum_t m_j g_t x_{t-j}, dx_t = sum_j m_j(t+j) g_{t+j} w[:, W-1-j] (and the
    halo's share)."""
    kernel = weight.shape[1]
    acc = _acc(x)
    masks = _masks(pos_in_doc, kernel, acc)
    slots = 1 if halo is None else halo.shape[1]
    ch = x.shape[-1]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dhalo = None if halo is None else torch.empty_like(halo, memory_format=torch.contiguous_format)
    dw = torch.empty_like(weight, dtype=acc, memory_format=torch.contiguous_format)
    from torchtitan_glm.models.glm5 import layers  # the chunk bound every recomputing backward shares (the planner's)

    step = max(1, layers.BWD_CHUNK_ELEMENTS // max(1, x.shape[0] * x.shape[1]))
    for c0 in range(0, ch, step):  # channel chunks (the conv is depthwise)
        cs = slice(c0, c0 + step)
        xf, w = x[..., cs].to(acc), weight[cs].to(acc)
        hc = None if halo is None else halo[..., cs]
        pre = _pre_activation(xf, w, hc, masks)
        s = torch.sigmoid(pre)
        g = grad_out[..., cs].to(acc) * (s * (1 + pre * (1 - s)))
        dw[cs, -1] = (g * xf).sum(dim=(0, 1))
        dxf = g * w[:, -1]
        dhf = None if dhalo is None else torch.zeros(halo[..., cs].shape, dtype=acc, device=x.device)
        for j in range(1, kernel):
            gm = g if masks[j] is None else g * masks[j]
            dw[cs, -1 - j] = (gm * _shifted(xf, hc, j, kernel)).sum(dim=(0, 1))
            tap = gm * w[:, -1 - j]
            dxf = dxf + _unshifted(tap, j, slots)
            if dhf is not None:  # the taps that read the halo: slot-local t < j reads halo row W-1-j+t
                per_slot = tap.reshape(tap.shape[0], slots, -1, tap.shape[-1])
                rows = min(j, per_slot.shape[2])
                dhf[:, :, kernel - 1 - j:kernel - 1 - j + rows] += per_slot[:, :, :rows]
        if dhf is not None:
            dhalo[..., cs] = dhf.to(dhalo.dtype)
        dx[..., cs] = dxf.to(dx.dtype)
    return dx, dw.to(weight.dtype), dhalo


# ---------------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------------


def _use_triton(x: Tensor, weight: Tensor, pos_in_doc: Tensor | None, halo: Tensor | None) -> bool:
    """The Triton kernels take one slot per row (no halo), the float dtypes Triton loads, up to four taps, and
    positions of x's [B, T] on x's device (the reference also broadcasts them)."""
    from .causal_conv_triton import MAX_TAPS

    return halo is None and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and (
        weight.shape[-1] <= MAX_TAPS) and (
        pos_in_doc is None or (pos_in_doc.shape == x.shape[:2] and pos_in_doc.device == x.device))


@torch.library.custom_op("torchtitan_glm::causal_conv_silu_fwd", mutates_args=(), device_types="cpu")
def causal_conv_silu_fwd(x: Tensor, weight: Tensor, pos_in_doc: Tensor | None, halo: Tensor | None) -> Tensor:
    """silu(conv(x)) in x's dtype. CPU: the torch reference."""
    with torch.autocast("cpu", enabled=False):
        return causal_conv_silu_reference(x, weight, pos_in_doc, halo).contiguous()


@causal_conv_silu_fwd.register_kernel("cuda")
def _fwd_cuda(x, weight, pos_in_doc, halo):
    with torch.cuda.device(x.device), torch.autocast("cuda", enabled=False):
        if _use_triton(x, weight, pos_in_doc, halo):
            from .causal_conv_triton import causal_conv_silu_fwd_triton

            return causal_conv_silu_fwd_triton(x.contiguous(), weight, pos_in_doc)
        return causal_conv_silu_reference(x, weight, pos_in_doc, halo).contiguous()


@causal_conv_silu_fwd.register_fake
def _fwd_fake(x, weight, pos_in_doc, halo):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("torchtitan_glm::causal_conv_silu_bwd", mutates_args=(), device_types="cpu")
def causal_conv_silu_bwd(grad_out: Tensor, x: Tensor, weight: Tensor, pos_in_doc: Tensor | None,
                         halo: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dhalo); dhalo is empty without a halo (a custom op returns tensors). CPU: the torch reference."""
    with torch.autocast("cpu", enabled=False):
        dx, dw, dhalo = causal_conv_silu_reference_bwd(grad_out, x, weight, pos_in_doc, halo)
    return dx, dw, x.new_empty(0) if dhalo is None else dhalo


@causal_conv_silu_bwd.register_kernel("cuda")
def _bwd_cuda(grad_out, x, weight, pos_in_doc, halo):
    with torch.cuda.device(x.device), torch.autocast("cuda", enabled=False):
        if _use_triton(x, weight, pos_in_doc, halo):
            from .causal_conv_triton import causal_conv_silu_bwd_triton

            dx, dw = causal_conv_silu_bwd_triton(grad_out, x.contiguous(), weight, pos_in_doc)
            return dx, dw.to(weight.dtype), x.new_empty(0)
        dx, dw, dhalo = causal_conv_silu_reference_bwd(grad_out, x, weight, pos_in_doc, halo)
        return dx, dw, x.new_empty(0) if dhalo is None else dhalo


@causal_conv_silu_bwd.register_fake
def _bwd_fake(grad_out, x, weight, pos_in_doc, halo):
    dhalo = x.new_empty(0) if halo is None else torch.empty_like(halo, memory_format=torch.contiguous_format)
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format), dhalo)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, pos_in_doc, halo = inputs
    ctx.save_for_backward(x, weight, pos_in_doc, halo)


def _backward(ctx, grad_out):
    x, weight, pos_in_doc, halo = ctx.saved_tensors
    dx, dw, dhalo = torch.ops.torchtitan_glm.causal_conv_silu_bwd(grad_out, x, weight, pos_in_doc, halo)
    return dx, dw, None, (None if halo is None else dhalo)


torch.library.register_autograd("torchtitan_glm::causal_conv_silu_fwd", _backward, setup_context=_setup_context)


def causal_conv_silu(x: Tensor, weight: Tensor, pos_in_doc: Tensor | None = None,
                     halo: Tensor | None = None) -> Tensor:
    """silu(depthwise causal conv) of x [B, T, C] with weight [C, W] (tap W-1 multiplies x_t, W-1-j x_{t-j}) in
    FP32, cast to x's dtype. pos_in_doc [B, T]: a tap reaching into the previous document reads zero (None: one
    document per row). halo [B, P, W-1, C]: the local T holds P slots, each preceded by its halo rows (context
    parallelism, decode). Autograd keeps x, weight, pos_in_doc and halo, nothing of [B, T, C] in FP32."""
    if halo is not None and torch.compiler.is_compiling() and torch.is_grad_enabled():
        # Context parallelism, compiled: the halo's slots have no Triton kernel, and the reference inside the opaque
        # op would run unfused (about a dozen kernels, 20 bytes of FP32 temporaries per channel and token). As the
        # plain expression in a checkpointed region inductor fuses it into one kernel and saves only the inputs;
        # the conv output is recomputed in backward.
        return checkpoint(causal_conv_silu_reference, x, weight, pos_in_doc, halo, use_reentrant=False)
    return torch.ops.torchtitan_glm.causal_conv_silu_fwd(x, weight, pos_in_doc, halo)
