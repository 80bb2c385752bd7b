"""Fused LM-head + cross-entropy over token chunks: the [tokens, vocab] logits never exist at once.

Hand-written because no maintained library in our dependency set provides it (Liger/Cut-CE are CUDA-only extra
dependencies). Each chunk's softmax gradient is formed right after its loss, so the backward only scales the
stored d(hidden) and d(weight): 3 GEMMs per chunk (logits, dX, dW) instead of 4 with recompute-checkpointing.
Several chunks sum their partial dW in an FP32 [vocab, D] buffer; one chunk (tokens <= chunk_size) writes its dW GEMM
in the weight's dtype and allocates no FP32 buffer (for the proxy's [154,880, 4,096] head: 2.4 GiB).
"""

from __future__ import annotations

import torch

from torchtitan_glm.ops.order_after import order_after

IGNORE_INDEX = -100


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, token_weights, chunk_size):
        n = hidden.shape[0]
        losses = hidden.new_zeros(n, dtype=torch.float32)
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_grad else None
        single = n <= chunk_size
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grad and not single \
            else None
        after: list[torch.Tensor] = []  # compiled: the previous chunk's results, which this chunk's GEMM waits for
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            h, y = hidden[s:e], labels[s:e]
            if after:  # one chunk's [chunk, vocab] tensors alive at a time (ops/order_after.py says why)
                h = order_after(h, after)
            keep = y != IGNORE_INDEX
            y_safe = torch.where(keep, y, torch.zeros_like(y))
            if torch.compiler.is_compiling():
                # Under inductor the FP32 logits are never written: the upcast is fused into the reductions and
                # into the one pointwise pass that writes the gradient in the weight's dtype (the one-hot term
                # as a column compare, which a scatter would not fuse). The working set is the GEMM's logits and
                # their gradient in the weight's dtype: at the proxy's LM head 2.4 GiB, where the FP32 buffer
                # and its in-place updates held about 6 (H100 memory snapshot, docs/performance.md).
                # The target logit is a masked sum over the vocabulary (exact: one term is not zero), so it
                # fuses into this chunk's logsumexp kernel. A gather would be fused into the kernel that fills
                # `losses` over all chunks, whose int32 offsets into each chunk's logits overflow past
                # 2^31 / vocab rows (an inductor fault, pytorch/pytorch#189108): an illegal memory access or a
                # garbage loss at 24,576 rows of the proxy's 154,880-word vocabulary (H100, torch 2.11,
                # docs/performance.md, twenty-eighth session).
                logits = h @ weight.t()
                lse = torch.logsumexp(logits.float(), dim=-1)
                hit = torch.arange(logits.shape[-1], device=logits.device) == y_safe.unsqueeze(-1)
                target = torch.where(hit, logits.float(), 0.0).sum(-1)
            else:
                logits = (h @ weight.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                target = logits.gather(-1, y_safe.unsqueeze(-1)).squeeze(-1)
            chunk_losses = torch.where(keep, lse - target, torch.zeros_like(lse))
            losses[s:e] = chunk_losses
            if need_grad:
                # d(sum_i w_i * loss_i)/d(logits) = w_i * (softmax_i - onehot_i), zero on ignored rows; the same
                # FP32 values either way (p - 1 where a scatter adds -1), rounded once to the weight's dtype.
                scale = (token_weights[s:e].float() * keep).unsqueeze(-1)
                if torch.compiler.is_compiling():
                    p = torch.exp(logits.float() - lse.unsqueeze(-1))
                    g = (torch.where(hit, p - 1.0, p) * scale).to(weight.dtype)
                else:  # in place over the FP32 logits: eager keeps one [chunk, vocab] FP32 tensor alive, not three
                    g = logits.sub_(lse.unsqueeze(-1)).exp_()
                    g.scatter_add_(-1, y_safe.unsqueeze(-1), -torch.ones_like(lse).unsqueeze(-1))
                    g = g.mul_(scale).to(weight.dtype)
                del logits
                # Both GEMMs take the weight's dtype, as nn.Linear's backward would: an FP32 dW GEMM of a
                # [vocab, chunk] x [chunk, D] product ran on SIMT cores and cost 100 ms a step on the H200 proxy.
                # The per-chunk partial dW is summed across chunks in FP32; a single chunk's is the gradient.
                chunk_grad_h = (g @ weight).to(hidden.dtype)
                grad_h[s:e] = chunk_grad_h
                part = g.t() @ h.to(weight.dtype)
                if single:
                    grad_w = part
                else:
                    grad_w += part.float()
            if torch.compiler.is_compiling() and e < n:
                after = [chunk_losses] + ([chunk_grad_h, grad_w] if need_grad else [])
        if need_grad and grad_w is None:  # no tokens
            grad_w = torch.zeros_like(weight)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        weighted = (losses * token_weights.float()).sum()
        ctx.mark_non_differentiable(losses)
        return weighted, losses

    @staticmethod
    def backward(ctx, grad_weighted, grad_losses):
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else grad_h * grad_weighted.to(grad_h.dtype)
        # a 0-dim FP32 factor keeps a one-chunk BF16 grad_w in BF16 (no FP32 [vocab, D] temporary)
        dw = None if grad_w is None else (grad_w * grad_weighted).to(ctx.weight_dtype)
        return dh, dw, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, token_weights: torch.Tensor, *,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, D], weight [V, D], labels [N] (-100 = ignore), token_weights [N].

    Returns (sum_i token_weights_i * CE_i, a differentiable scalar; per-token CE [N] FP32, 0 where ignored,
    not differentiable). CE is computed from FP32 logits; the GEMMs run in the weight's dtype and the per-chunk
    dW is accumulated in FP32 when there are several chunks.
    """
    return _LinearCrossEntropy.apply(hidden, weight, labels, token_weights, chunk_size)
