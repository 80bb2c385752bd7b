"""KDA's log-decay Function (models/glm5/kda_gate.py), bounded and unbounded: forward bit-identical to the plain FP32
expression, gradients against fp64 autograd (chunked backward included), gradcheck, no FP32 copy held."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.saved import saved_for_backward
from torchtitan_glm.models.glm5 import layers
from torchtitan_glm.models.glm5.kda_gate import kda_log_decay

HEADS, DIM = 3, 8


def _plain(f, a_log, dt, lower_bound):
    wide = torch.promote_types(f.dtype, torch.float32)
    g = (f.to(wide) + dt.to(wide)).unflatten(-1, (-1, DIM))
    rate = torch.exp(a_log.to(wide)).view(-1, 1)
    return lower_bound * torch.sigmoid(rate * g) if lower_bound is not None else -rate * F.softplus(g)


def _inputs(dtype, seed=0, tokens=(2, 10)):
    g = torch.Generator().manual_seed(seed)
    f = (torch.randn(*tokens, HEADS * DIM, generator=g) * 2).to(dtype)
    a_log = torch.rand(HEADS, generator=g) * 2
    dt = torch.randn(HEADS * DIM, generator=g) - 3
    return f, a_log, dt


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_the_plain_expression_bit_for_bit(lower_bound, dtype):
    f, a_log, dt = _inputs(dtype)
    got = kda_log_decay(f, a_log, dt, head_dim=DIM, lower_bound=lower_bound)
    assert got.dtype == torch.float32 and torch.equal(got, _plain(f, a_log, dt, lower_bound))


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("chunk", [1 << 26, HEADS * DIM * 3])  # one chunk; 3 token rows per chunk
def test_gradients_match_fp64_autograd(lower_bound, chunk, monkeypatch):
    monkeypatch.setattr(layers, "BWD_CHUNK_ELEMENTS", chunk)
    leaves = [t.requires_grad_(True) for t in _inputs(torch.float32, seed=1)]
    y = kda_log_decay(*leaves, head_dim=DIM, lower_bound=lower_bound)
    ref = [t.detach().double().requires_grad_(True) for t in leaves]
    want = _plain(*ref, lower_bound)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    for name, a, b in zip(("f", "A_log", "dt_bias"), torch.autograd.grad(y, leaves, dy),
                          torch.autograd.grad(want, ref, dy.double())):
        # FP32 against fp64 on each gradient's scale: 1 - sigmoid near 1 cancels in FP32 (autograd's too)
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * float(b.abs().max()), msg=name)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gradcheck_fp64(lower_bound):
    leaves = tuple(t.double().requires_grad_(True) for t in _inputs(torch.float64, seed=2, tokens=(1, 3)))
    assert torch.autograd.gradcheck(lambda f, a, d: kda_log_decay(f, a, d, head_dim=DIM, lower_bound=lower_bound),
                                    leaves)


def test_bf16_gate_output_is_all_that_is_held():
    f, a_log, dt = _inputs(torch.bfloat16, seed=3)
    f.requires_grad_(True)
    with saved_for_backward() as held:
        y = kda_log_decay(f, a_log, dt, head_dim=DIM, lower_bound=None)
    assert [(tuple(t.shape), t.dtype) for t in held if t.numel() >= f.numel()] == [(tuple(f.shape), torch.bfloat16)]
    y.sum().backward()
    assert f.grad.dtype == torch.bfloat16
