"""KDA's gated output norm: per-head RMSNorm in FP32 times sigmoid(gate), one cast, as an autograd Function that keeps
its inputs in their own dtype for backward and recomputes the FP32 rest."""

from __future__ import annotations

import torch

from .layers import at_least_fp32, bwd_chunks


class _GatedRmsNorm(torch.autograd.Function):
    """(x r w) sigmoid(gate) with r = rsqrt(mean(x^2) + eps), saving x, gate, w and r.

    Autograd of the plain expression keeps four FP32 tensors of the KDA output's size (x.float(), its scaled copy,
    the normalised output and sigmoid(gate)): 16 bytes per channel and token, 16 GiB per KDA block at T = 128K on
    the proxy in an eager backward. Here: the BF16 x and gate and one FP32 scale per row. With xn = x r, y = xn w,
    s = sigmoid(gate): d gate = g y s (1 - s), dw = sum g s xn, dx = r (dn - xn mean(dn xn)) with dn = g s w."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = at_least_fp32(x)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = xf * r * at_least_fp32(weight)
        ctx.save_for_backward(x, gate, weight, r)
        out = y * torch.sigmoid(at_least_fp32(gate))
        # no `.to` where it would return its input: under torch 2.11's dynamo that made the compiled gradients of
        # every input zeros in FP32 (docs/performance.md, thirty-first session)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, gate, weight, r = ctx.saved_tensors
        want_x, want_gate, want_w, _ = ctx.needs_input_grad
        width = x.shape[-1]
        acc = torch.promote_types(x.dtype, torch.float32)
        xs, gs, os_, rs = (t.reshape(-1, t.shape[-1]) for t in (x, gate, grad_out, r))
        w = weight.to(acc)
        dx = torch.empty_like(xs) if want_x else None
        dgate = torch.empty_like(gs) if want_gate else None
        dw = torch.zeros(width, dtype=acc, device=x.device) if want_w else None
        for part in bwd_chunks(xs.shape[0], width):
            xn = xs[part].to(acc) * rs[part]
            sg = torch.sigmoid(gs[part].to(acc))
            g = os_[part].to(acc)
            if dgate is not None:
                dgate[part] = (g * (xn * w) * sg * (1 - sg)).to(dgate.dtype)
            gs_ = g * sg
            if dw is not None:
                dw += (gs_ * xn).sum(0)
            if dx is not None:
                dn = gs_ * w
                dx[part] = (rs[part] * (dn - xn * (dn * xn).mean(-1, keepdim=True))).to(dx.dtype)
        return (None if dx is None else dx.view(x.shape), None if dgate is None else dgate.view(gate.shape),
                None if dw is None else dw.to(weight.dtype), None)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim in FP32, times weight and sigmoid(gate), cast to x's dtype; backward holds
    x and gate, not FP32 copies."""
    return _GatedRmsNorm.apply(x, gate, weight, eps)
