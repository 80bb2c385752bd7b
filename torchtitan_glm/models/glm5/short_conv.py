"""The KDA short conv's math: depthwise causal conv + SiLU in FP32, restarted at document boundaries, as an autograd
Function that keeps its input in its own dtype for backward and recomputes the rest; under torch.compile, as the
plain expression in a checkpointed region, which saves the same."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .layers import at_least_fp32, bwd_chunks


def _shifted(xf: torch.Tensor, halo: torch.Tensor | None, j: int, kernel: int) -> torch.Tensor:
    """x_{t-j} for every t of xf [B, T, C] (FP32): zeros before the row starts, or with halo [B, P, W-1, C] the
    tokens before each of the P slots the local T holds."""
    if halo is None:
        return F.pad(xf[:, :-j], (0, 0, j, 0)) if j < xf.shape[1] else torch.zeros_like(xf)
    bsz, seqlen, ch = xf.shape
    slots = halo.shape[1]
    padded = torch.cat([halo.to(xf.dtype), xf.reshape(bsz, slots, seqlen // slots, ch)], dim=2)
    return padded[:, :, kernel - 1 - j:padded.shape[2] - j].reshape(xf.shape)


def _unshifted(a: torch.Tensor, j: int, slots: int) -> torch.Tensor:
    """The adjoint of _shifted on the local tokens: a_{t+j} within each slot, zeros past its end."""
    bsz, seqlen, ch = a.shape
    a = a.reshape(bsz, slots, seqlen // slots, ch)
    return F.pad(a[:, :, j:], (0, 0, 0, min(j, a.shape[2]))).reshape(bsz, seqlen, ch)


def _masks(pos_in_doc: torch.Tensor | None, kernel: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Per tap j, 1 where x_{t-j} is in t's document (pos_in_doc >= j); None: every tap is (one document)."""
    if pos_in_doc is None:
        return [None] * kernel
    return [None] + [(pos_in_doc >= j).unsqueeze(-1).to(dtype) for j in range(1, kernel)]


def _pre_activation(xf: torch.Tensor, w: torch.Tensor, halo: torch.Tensor | None,
                    masks: list[torch.Tensor | None]) -> torch.Tensor:
    """sum_j m_j x_{t-j} w[:, W-1-j] in FP32, in the order the forward has always used (bit-identical)."""
    kernel = w.shape[1]
    out = xf * w[:, -1]
    for j in range(1, kernel):
        shifted = _shifted(xf, halo, j, kernel)
        if masks[j] is not None:
            shifted = shifted * masks[j]
        out = out + shifted * w[:, -1 - j]
    return out


def _conv_silu(x: torch.Tensor, weight: torch.Tensor, pos_in_doc: torch.Tensor | None,
               halo: torch.Tensor | None) -> torch.Tensor:
    """The forward expression: silu(pre-activation) in FP32, cast to x's dtype."""
    xf = at_least_fp32(x)
    pre = _pre_activation(xf, at_least_fp32(weight), halo, _masks(pos_in_doc, weight.shape[1], xf.dtype))
    return F.silu(pre).to(x.dtype)


class _CausalConvSilu(torch.autograd.Function):
    """silu(conv(x)) that saves x (BF16 in training), the weight, the positions and the halo.

    Autograd of the plain expression keeps the W-1 shifted taps of each conv in FP32 (36 bytes per channel and
    token for W = 4: 36 GiB per KDA block at T = 128K on the proxy, the largest term of the block's recompute,
    docs/performance.md). The backward recomputes the pre-activation per channel chunk; with g = dy silu'(pre):
    dw[:, W-1-j] = sum_t m_j g_t x_{t-j}, dx_t = sum_j m_j(t+j) g_{t+j} w[:, W-1-j] (and the halo's share)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, pos_in_doc: torch.Tensor | None,
                halo: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, pos_in_doc, halo)
        return _conv_silu(x, weight, pos_in_doc, halo)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, pos_in_doc, halo = ctx.saved_tensors
        kernel = weight.shape[1]
        want_x, want_w, _, want_halo = ctx.needs_input_grad
        acc = torch.promote_types(x.dtype, torch.float32)
        masks = _masks(pos_in_doc, kernel, acc)
        slots = 1 if halo is None else halo.shape[1]
        ch = x.shape[-1]
        dx = torch.empty_like(x) if want_x else None
        dhalo = torch.empty_like(halo) if want_halo and halo is not None else None
        dw = torch.empty_like(weight, dtype=acc) if want_w else None
        for cs in bwd_chunks(ch, x.shape[0] * x.shape[1]):  # channel chunks (the conv is depthwise)
            xf, w = x[..., cs].to(acc), weight[cs].to(acc)
            hc = None if halo is None else halo[..., cs]
            pre = _pre_activation(xf, w, hc, masks)
            s = torch.sigmoid(pre)
            g = grad_out[..., cs].to(acc) * (s * (1 + pre * (1 - s)))
            if dw is not None:
                dw[cs, -1] = (g * xf).sum(dim=(0, 1))
            dxf = g * w[:, -1]
            dhf = None if dhalo is None else torch.zeros(halo[..., cs].shape, dtype=acc, device=x.device)
            for j in range(1, kernel):
                gm = g if masks[j] is None else g * masks[j]
                if dw is not None:
                    dw[cs, -1 - j] = (gm * _shifted(xf, hc, j, kernel)).sum(dim=(0, 1))
                tap = gm * w[:, -1 - j]
                dxf = dxf + _unshifted(tap, j, slots)
                if dhf is not None:  # the taps that read the halo: slot-local t < j reads halo row W-1-j+t
                    per_slot = tap.reshape(tap.shape[0], slots, -1, tap.shape[-1])
                    rows = min(j, per_slot.shape[2])
                    dhf[:, :, kernel - 1 - j:kernel - 1 - j + rows] += per_slot[:, :, :rows]
            if dhf is not None:
                dhalo[..., cs] = dhf.to(dhalo.dtype)
            if dx is not None:
                dx[..., cs] = dxf.to(dx.dtype)
        return dx, (None if dw is None else dw.to(weight.dtype)), None, dhalo


def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, pos_in_doc: torch.Tensor | None = None,
                     halo: torch.Tensor | None = None) -> torch.Tensor:
    """silu(depthwise causal conv) of x [B, T, C] with weight [C, W] (tap W-1 multiplies x_t, W-1-j x_{t-j}) in
    FP32, cast to x's dtype. pos_in_doc [B, T]: a tap reaching into the previous document reads zero (None: one
    document per row). halo [B, P, W-1, C]: the local T holds P slots, each preceded by its halo rows (context
    parallelism, decode)."""
    if torch.compiler.is_compiling() and torch.is_grad_enabled():
        # Compiled, AOTAutograd's partitioner keeps three FP32 [B, T, C] intermediates of the Function for its
        # backward, 12 bytes per channel and token where x is 2 (1.1 GiB per proxy KDA layer at T = 4,096,
        # measured on an H200), instead of recomputing them from x. The plain expression in a checkpointed region
        # saves only its inputs, under torch 2.11 and 2.13 alike; the Function in one does not under 2.11.
        # (tests/unit/test_short_conv.py reads the saved tensors.)
        return checkpoint(_conv_silu, x, weight, pos_in_doc, halo, use_reentrant=False)
    return _CausalConvSilu.apply(x, weight, pos_in_doc, halo)
