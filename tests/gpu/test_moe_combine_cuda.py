"""The MoE combine on CUDA in BF16 (models/glm5/moe.py::MoE._routed): the same output, input-gradient and
routing-weight-gradient bits run to run, eager and compiled (no atomics), and in eager each output within half a BF16
ulp of the exact sum of its k rounded products (one rounding; inductor keeps the products in FP32, so the bound is
checked in eager only)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_moe_combine import _fake_experts, _half_ulp, _moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_combine_is_deterministic_and_rounds_once(compiled):
    moe = _moe(torch.bfloat16).cuda()
    moe.experts.forward = _fake_experts
    gen = torch.Generator(device="cuda").manual_seed(1)
    flat = (torch.randn(4096, moe.gate.weight.shape[1], generator=gen, device="cuda") * 3).bfloat16()
    _, idx, weights = moe.gate(flat)
    routed = torch.compile(moe._routed, fullgraph=True) if compiled else moe._routed
    grad_out = torch.randn(flat.shape, generator=gen, device="cuda").bfloat16()
    runs = []
    for _ in range(2):
        # fresh leaves each run: the routing weights' gradient is part of the combine's backward too
        x, w = flat.detach().requires_grad_(), weights.detach().requires_grad_()
        out = routed(x, idx, w)[0]
        out.backward(grad_out)
        runs.append((out.detach(), x.grad, w.grad))
    (first, grad1, wgrad1), (second, grad2, wgrad2) = runs
    assert torch.equal(first, second) and torch.equal(grad1, grad2) and torch.equal(wgrad1, wgrad2)
    if not compiled:
        y = flat.unsqueeze(1) * (1 + idx / 7).to(torch.bfloat16).unsqueeze(-1)
        exact = (y * weights.unsqueeze(-1).to(torch.bfloat16)).double().sum(1)
        assert ((first.double() - exact).abs() <= _half_ulp(exact)).all()
