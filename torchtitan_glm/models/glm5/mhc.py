"""mHC (manifold-constrained hyper-connections): hc_mult residual streams mixed around each attention/MLP site.

All mappings are computed in FP32 (`keep_fp32`): RMS with eps inside the sqrt, sigmoid+eps pre, 2*sigmoid post,
softmax+eps then Sinkhorn for the doubly-stochastic comb, residual mixed with comb transposed.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import bwd_chunks


class _RmsLinear(torch.autograd.Function):
    """linear(rms_scale(x.float()), w) that saves x in its own dtype and the per-row scale, not FP32 copies.

    Autograd of the plain expression keeps two FP32 copies of the flattened streams per mHC site (x.float() and its
    scaled copy): 4 GiB each per site at T = 64K on the proxy, measured as the second-largest live entry when 64K ran
    out of memory (docs/performance.md). The forward here computes the same expression (bit-identical); the backward
    recomputes the scaled rows in chunks: with xn = x r, r = rsqrt(mean(x^2) + eps) and g = grad_out w,
    dx = r (g - xn mean(g xn)), dw = grad_out^T xn."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return torch.nn.functional.linear(xf * r, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        width = x.shape[-1]
        xs, gs, rs = x.reshape(-1, width), grad_out.reshape(-1, grad_out.shape[-1]).float(), r.reshape(-1, 1)
        wf = weight.float()
        dx = torch.empty_like(xs) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for part in bwd_chunks(xs.shape[0], width):
            xn = xs[part].float() * rs[part]
            if dw is not None:
                dw += gs[part].t() @ xn
            if dx is not None:
                g = gs[part] @ wf
                dx[part] = (rs[part] * (g - xn * (g * xn).mean(-1, keepdim=True))).to(dx.dtype)
        return (None if dx is None else dx.view(x.shape)), (None if dw is None else dw.to(weight.dtype)), None


def rms_linear(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """F.linear(x.float() * rsqrt(mean(x.float()^2, -1) + eps), weight) in FP32, holding x (not FP32 copies) for
    backward."""
    return _RmsLinear.apply(x, weight, eps)


def sinkhorn(logits: torch.Tensor, *, iters: int, eps: float) -> torch.Tensor:
    """Doubly-stochastic projection of [..., n, n] logits: row softmax + eps, column norm, then
    (iters-1) x (row, col)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mix_streams(comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """comb^T applied to the streams: out_i = sum_j comb[j, i] x_j, comb [..., n, n], streams [..., n, D].

    Eager: one batched matmul (what the reference computes). Compiled: the same sum written out over j, which
    inductor unrolls (n <= 8 terms) into the pointwise kernel of the merge around it: one pass over the streams, where
    a [T, n, n] x [T, n, D] bmm is a separate cuBLAS call with an inner dimension of n, far from the memory bandwidth
    (docs/performance.md, eleventh session). The bmm and inductor's kernel both accumulate in FP32: they differ in
    summation order only."""
    comb_t = comb.transpose(-1, -2)
    if torch.compiler.is_compiling():
        return (comb_t.unsqueeze(-1) * streams.unsqueeze(-3)).sum(dim=-2)
    return torch.matmul(comb_t, streams)


class HyperConnection(nn.Module):
    """One mHC site: from the streams [B, T, n, D] compute (post, comb, collapsed block input)."""

    keep_fp32 = True

    def __init__(self, *, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                 fp32_mixing: bool = False) -> None:
        super().__init__()
        self.hc_mult = hc_mult
        self.fp32_mixing = fp32_mixing
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.hc_mult
        mix = rms_linear(streams.flatten(-2), self.fn.float(), eps=self.norm_eps)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * s_post + post_b)
        comb_logits = comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n)
        comb = sinkhorn(comb_logits, iters=self.sinkhorn_iters, eps=self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed

    def merge(self, residual: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
        """New streams: out_i = post_i * y + sum_j comb[j, i] * x_j (comb applied transposed).

        By default (the reference) post and comb are cast to the streams' dtype first and mixed there; with
        `fp32_mixing` (Megatron's mhc_keep_mappings_in_fp32) the mixing runs in FP32 with one final cast."""
        if self.fp32_mixing:
            out = post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2) + mix_streams(
                comb.float(), residual.float())
            return out.to(residual.dtype)
        dtype = residual.dtype
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + mix_streams(comb.to(dtype), residual)

    def init_weights(self) -> None:
        nn.init.normal_(self.fn, mean=0.0, std=0.02)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)


class LearnedHcHead(nn.Module):
    """DeepSeek-V4-style learned stream contraction (option; GLM-5.3-Flash contracts by the plain mean)."""

    keep_fp32 = True

    def __init__(self, *, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mix = rms_linear(streams.flatten(-2), self.fn.float(), eps=self.norm_eps)
        pre = torch.sigmoid(mix * self.scale.float() + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)

    def init_weights(self) -> None:
        nn.init.normal_(self.fn, mean=0.0, std=0.02)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)


def mean_hc_head(streams: torch.Tensor) -> torch.Tensor:
    """GLM-5.3-Flash's final contraction: the unweighted mean over the streams."""
    return streams.mean(dim=-2)
