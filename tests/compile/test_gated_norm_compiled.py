"""KDA's gated output norm (an autograd.Function with its own backward) compiled with fullgraph=True gives eager's
gradients. On torch 2.11 (dynamo alone: backend "eager") the compiled gradients of all three inputs came out as zeros
in FP32 while the forward ended in a `.to` that returned its input (docs/performance.md, thirty-first session)."""

from __future__ import annotations

import torch

from torchtitan_glm.models.glm5.gated_norm import gated_rms_norm


def test_compiled_gated_norm_gradients_equal_eager():
    torch.manual_seed(0)
    x, gate = torch.randn(1, 32, 4, 16), torch.randn(1, 32, 4, 16)
    weight, grad_out = torch.randn(16), torch.randn(1, 32, 4, 16)

    def grads(fn):
        inputs = [t.clone().requires_grad_() for t in (x, gate, weight)]
        fn(*inputs).backward(grad_out)
        return [t.grad for t in inputs]

    def norm(a, b, c):
        return gated_rms_norm(a, b, c, eps=1e-6)

    want = grads(norm)
    got = grads(torch.compile(norm, backend="eager", fullgraph=True))
    for name, g, w in zip(("x", "gate", "weight"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"d{name}: {m}")
