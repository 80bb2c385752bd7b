"""KDA's gated output norm Function (models/glm5/gated_norm.py): forward bit-identical to the plain FP32 expression,
gradients against fp64 autograd (chunked backward included), gradcheck, and no FP32 copy held for backward."""

from __future__ import annotations

import pytest
import torch

from tests.saved import saved_for_backward
from torchtitan_glm.models.glm5 import layers
from torchtitan_glm.models.glm5.gated_norm import gated_rms_norm

EPS = 1e-6


def _plain(x, gate, w):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.to(xf.dtype)
    return (y * torch.sigmoid(gate.to(xf.dtype))).to(x.dtype)


def _inputs(dtype, seed=0, shape=(2, 12, 3, 16)):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    gate = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x, gate, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_the_plain_expression_bit_for_bit(dtype):
    x, gate, w = _inputs(dtype)
    assert torch.equal(gated_rms_norm(x, gate, w, eps=EPS), _plain(x, gate, w))


@pytest.mark.parametrize("chunk", [1 << 26, 16 * 5])  # one chunk; 5 rows per chunk (the last one short)
def test_gradients_match_fp64_autograd(chunk, monkeypatch):
    monkeypatch.setattr(layers, "BWD_CHUNK_ELEMENTS", chunk)
    x, gate, w = (t.requires_grad_(True) for t in _inputs(torch.float32, seed=1))
    y = gated_rms_norm(x, gate, w, eps=EPS)
    ref = [t.detach().double().requires_grad_(True) for t in (x, gate, w)]
    want = _plain(*ref)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(y.dtype)
    for name, a, b in zip(("x", "gate", "weight"), torch.autograd.grad(y, (x, gate, w), dy),
                          torch.autograd.grad(want, ref, dy.double())):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6 * float(b.abs().max()), msg=name)


def test_gradcheck_fp64():
    x, gate, w = (t.double().requires_grad_(True) for t in _inputs(torch.float64, seed=2, shape=(3, 2, 4)))
    assert torch.autograd.gradcheck(lambda a, b, c: gated_rms_norm(a, b, c, eps=EPS), (x, gate, w))


def test_bf16_keeps_inputs_and_one_scale_per_row():
    x, gate, w = _inputs(torch.bfloat16, seed=3)
    x.requires_grad_(True)
    gate.requires_grad_(True)
    with saved_for_backward() as held:
        y = gated_rms_norm(x, gate, w, eps=EPS)
    assert sorted((tuple(t.shape), t.dtype) for t in held if t.numel() >= x.numel()) == \
        sorted([(tuple(x.shape), torch.bfloat16)] * 2)
    assert [tuple(t.shape) for t in held if t.dtype == torch.float32] == [(*x.shape[:-1], 1)]
    y.float().sum().backward()
    assert x.grad.dtype == gate.grad.dtype == torch.bfloat16
