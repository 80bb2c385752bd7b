"""The clamped SwiGLU Function (models/glm5/layers.py::swiglu): forward bit-identical to the plain expression,
gradients against fp64 autograd with values on both sides of the clamps (chunked backward included), gradcheck away
from the clamps' kinks, and only gate and up held for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.saved import saved_for_backward
from torchtitan_glm.models.glm5 import layers
from torchtitan_glm.models.glm5.layers import swiglu

LIMIT = 1.5


def _plain(gate, up, limit=LIMIT):
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _inputs(dtype, seed=0, shape=(3, 7, 20)):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * 2).to(dtype)
    up = (torch.randn(shape, generator=g) * 2).to(dtype)
    gate.view(-1)[:3] = LIMIT  # exactly at the bound: autograd's clamp passes the gradient there
    up.view(-1)[3:6] = -LIMIT
    return gate, up


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_the_plain_expression_bit_for_bit(dtype):
    gate, up = _inputs(dtype)
    assert torch.equal(swiglu(gate, up, LIMIT), _plain(gate, up))


@pytest.mark.parametrize("chunk", [1 << 26, 20 * 4])  # one chunk; 4 rows per chunk (the last one short)
def test_gradients_match_fp64_autograd(chunk, monkeypatch):
    monkeypatch.setattr(layers, "BWD_CHUNK_ELEMENTS", chunk)
    gate, up = (t.requires_grad_(True) for t in _inputs(torch.float32, seed=1))
    assert (gate.detach() > LIMIT).any() and (up.detach().abs() > LIMIT).any()  # both clamps are active somewhere
    y = swiglu(gate, up, LIMIT)
    ref = [t.detach().double().requires_grad_(True) for t in (gate, up)]
    want = _plain(*ref)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    for name, a, b in zip(("gate", "up"), torch.autograd.grad(y, (gate, up), dy),
                          torch.autograd.grad(want, ref, dy.double())):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6 * float(b.abs().max()), msg=name)


def test_gradcheck_fp64():
    g = torch.Generator().manual_seed(2)
    gate = (torch.rand(4, 5, generator=g, dtype=torch.float64) * 6 - 3)
    up = (torch.rand(4, 5, generator=g, dtype=torch.float64) * 6 - 3)
    for t in (gate, up):  # finite differences need a margin from the kinks at +-LIMIT
        t[(t - LIMIT).abs() < 0.05] += 0.1
        t[(t + LIMIT).abs() < 0.05] -= 0.1
    assert torch.autograd.gradcheck(lambda a, b: swiglu(a, b, LIMIT),
                                    (gate.requires_grad_(True), up.requires_grad_(True)))


def test_bf16_holds_gate_and_up_only():
    gate, up = (t.requires_grad_(True) for t in _inputs(torch.bfloat16, seed=3))
    with saved_for_backward() as held:
        y = swiglu(gate, up, LIMIT)
    assert len(held) == 2 and all(t.dtype == torch.bfloat16 and t.shape == gate.shape for t in held)
    y.float().sum().backward()
    assert gate.grad.dtype == up.grad.dtype == torch.bfloat16
