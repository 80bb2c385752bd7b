"""KDA's per-channel log decay from the low-rank gate output, in FP32, as an autograd Function that keeps the gate
output in its own dtype for backward and recomputes the FP32 rest."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import at_least_fp32, bwd_chunks


def _gate_and_rate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g = f + dt_bias as [..., H, K], rate = exp(A_log) as [H, 1]), in FP32 or wider."""
    g = (at_least_fp32(f) + at_least_fp32(dt_bias)).unflatten(-1, (-1, head_dim))
    return g, torch.exp(at_least_fp32(a_log)).view(-1, 1)


class _KdaDecay(torch.autograd.Function):
    """lower_bound sigmoid(e^A g) or -e^A softplus(g), g = f + dt_bias, saving f, A_log and dt_bias.

    Autograd of the plain expression keeps two FP32 tensors of the decay's size besides the output (g and the
    sigmoid / softplus result): 8 bytes per channel and token, 8 GiB per KDA block at T = 128K on the proxy in an
    eager backward. Bounded, with z = e^A g and s = sigmoid(z): dz = d lower_bound s (1 - s), dg = e^A dz,
    dA = e^A sum(dz g). Unbounded: dg = -e^A sigmoid(g) d, dA = -e^A sum(d softplus(g))."""

    @staticmethod
    def forward(ctx, f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int,
                lower_bound: float | None) -> torch.Tensor:
        ctx.head_dim, ctx.lower_bound = head_dim, lower_bound
        ctx.save_for_backward(f, a_log, dt_bias)
        g, rate = _gate_and_rate(f, a_log, dt_bias, head_dim)
        if lower_bound is not None:
            return lower_bound * torch.sigmoid(rate * g)
        return -rate * F.softplus(g)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        f, a_log, dt_bias = ctx.saved_tensors
        want_f, want_a, want_dt, _, _ = ctx.needs_input_grad
        channels = f.shape[-1]
        acc = torch.promote_types(f.dtype, torch.float32)
        fs, gs = f.reshape(-1, channels), grad_out.reshape(-1, channels)
        df = torch.empty_like(fs) if want_f else None
        d_rate = torch.zeros(a_log.shape[0], 1, dtype=acc, device=f.device)
        d_dt = torch.zeros(channels, dtype=acc, device=f.device)
        for part in bwd_chunks(fs.shape[0], channels):
            g, rate = _gate_and_rate(fs[part], a_log, dt_bias, ctx.head_dim)
            d = gs[part].to(acc).unflatten(-1, g.shape[-2:])
            if ctx.lower_bound is not None:
                sg = torch.sigmoid(rate * g)
                dz = d * ctx.lower_bound * sg * (1 - sg)
                d_rate += (dz * g).sum(dim=(0, 2)).unsqueeze(-1)
                dg = dz * rate
            else:
                d_rate -= (d * F.softplus(g)).sum(dim=(0, 2)).unsqueeze(-1)
                dg = -rate * d * torch.sigmoid(g)
            dg = dg.flatten(-2)
            d_dt += dg.sum(0)
            if df is not None:
                df[part] = dg.to(df.dtype)
        rate = torch.exp(at_least_fp32(a_log))
        return (None if df is None else df.view(f.shape),
                (d_rate.squeeze(-1) * rate).to(a_log.dtype) if want_a else None,
                d_dt.to(dt_bias.dtype) if want_dt else None, None, None)


def kda_log_decay(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, *, head_dim: int,
                  lower_bound: float | None) -> torch.Tensor:
    """Per-channel log decay [..., H, K] in FP32 from the gate output f [..., H*K]: lower_bound sigmoid(e^A_log g)
    with a lower bound, else -e^A_log softplus(g), g = f + dt_bias; backward holds f, not FP32 copies."""
    return _KdaDecay.apply(f, a_log, dt_bias, head_dim, lower_bound)
