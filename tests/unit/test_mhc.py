"""mHC maps' RMS-scaled projection (models/glm5/mhc.py::rms_linear): same forward as the plain expression, the same
gradients, and no FP32 copy of the streams held for backward."""

from __future__ import annotations

import pytest
import torch

from tests.saved import saved_for_backward
from torchtitan_glm.models.glm5 import layers, mhc
from torchtitan_glm.models.glm5.mhc import HyperConnection, rms_linear


def _plain(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return torch.nn.functional.linear(xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_linear_matches_autograd_of_the_plain_expression(monkeypatch, dtype):
    monkeypatch.setattr(layers, "BWD_CHUNK_ELEMENTS", 256 * 10)  # 10-row chunks: 111 rows -> 12 chunks, last partial
    torch.manual_seed(0)
    x = (torch.randn(3, 37, 256) * 3).to(dtype).requires_grad_()
    w = (torch.randn(24, 256) * 0.02).requires_grad_()
    y = rms_linear(x, w, eps=1e-6)
    ref = _plain(x, w, 1e-6)
    assert torch.equal(y, ref)  # the forward is the same expression
    g = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    rdx, rdw = torch.autograd.grad(ref, (x, w), g)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    assert torch.allclose(dw, rdw, rtol=1e-5, atol=1e-5 * rdw.abs().max().item())
    if dtype == torch.float32:
        assert torch.allclose(dx, rdx, rtol=1e-5, atol=1e-5 * rdx.abs().max().item())
    else:  # both round an FP32 gradient to BF16: at most one BF16 ulp apart
        assert ((dx.float() - rdx.float()).abs() <= rdx.float().abs() * 2**-7 + 1e-6).all()


def test_rms_linear_input_grad_only_and_weight_grad_only():
    torch.manual_seed(1)
    x = torch.randn(5, 64, requires_grad=True)
    w = torch.randn(8, 64) * 0.1
    (dx,) = torch.autograd.grad(rms_linear(x, w, eps=1e-6).square().sum(), (x,))
    (rdx,) = torch.autograd.grad(_plain(x, w, 1e-6).square().sum(), (x,))
    assert torch.allclose(dx, rdx, rtol=1e-5, atol=1e-6)
    x2, w2 = x.detach(), w.clone().requires_grad_()
    (dw,) = torch.autograd.grad(rms_linear(x2, w2, eps=1e-6).sum(), (w2,))
    (rdw,) = torch.autograd.grad(_plain(x2, w2, 1e-6).sum(), (w2,))
    assert torch.allclose(dw, rdw, rtol=1e-5, atol=1e-6)


def _saved_bytes(fn) -> list[tuple[torch.dtype, int]]:
    with saved_for_backward() as held:
        fn()
    return [(t.dtype, t.numel()) for t in held]


def test_hyper_connection_saves_no_fp32_copy_of_the_streams():
    torch.manual_seed(2)
    hc = HyperConnection(hidden_size=64, hc_mult=4, sinkhorn_iters=3, hc_eps=1e-6, norm_eps=1e-6)
    hc.init_weights()
    streams = torch.randn(1, 32, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    big = streams.numel()
    saved = _saved_bytes(lambda: hc(streams))
    fp32_big = [s for s in saved if s[0] == torch.float32 and s[1] >= big]
    assert not fp32_big, f"FP32 tensors of the streams' size saved for backward: {fp32_big}"
    # the plain expression (what the module ran before) does save them: the check can fail
    plain = _saved_bytes(lambda: _plain(streams.flatten(-2), hc.fn, hc.norm_eps))
    assert [s for s in plain if s[0] == torch.float32 and s[1] >= big]


def test_hyper_connection_forward_and_grads_match_the_plain_maps():
    """The module's outputs against an independent FP64 computation of its maps (pre, post, Sinkhorn comb)."""
    torch.manual_seed(3)
    n, d = 4, 32
    hc = HyperConnection(hidden_size=d, hc_mult=n, sinkhorn_iters=5, hc_eps=1e-6, norm_eps=1e-6)
    hc.init_weights()
    with torch.no_grad():
        hc.base.normal_(0, 0.3)
        hc.scale.copy_(torch.tensor([0.7, 1.3, 0.9]))
    streams = torch.randn(2, 9, n, d, requires_grad=True)
    post, comb, collapsed = hc(streams)

    x = streams.detach().double().flatten(-2)
    xn = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    mix = xn @ hc.fn.detach().double().t()
    b, s = hc.base.detach().double(), hc.scale.detach().double()
    pre = torch.sigmoid(mix[..., :n] * s[0] + b[:n]) + 1e-6
    ref_post = 2 * torch.sigmoid(mix[..., n:2 * n] * s[1] + b[n:2 * n])
    logits = (mix[..., 2 * n:] * s[2] + b[2 * n:]).unflatten(-1, (n, n))
    ref_comb = mhc.sinkhorn(logits, iters=5, eps=1e-6)
    ref_collapsed = (pre.unsqueeze(-1) * streams.detach().double()).sum(-2)
    for got, ref in ((post, ref_post), (comb, ref_comb), (collapsed, ref_collapsed)):
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fp32_mixing", [False, True])
def test_compiled_merge_is_one_pass_without_bmm_and_matches_eager(fp32_mixing):
    """Under inductor the streams' mixing (comb^T x) is written out as an n-term sum, fused with the post term, where
    eager runs a batched matmul: no extern bmm in the forward or backward code, and the same outputs and gradients
    as eager (FP32: summation order only). The matmul form does leave an extern bmm: the check can fail."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(4)
    n, d = 4, 64
    hc = HyperConnection(hidden_size=d, hc_mult=n, sinkhorn_iters=3, hc_eps=1e-6, norm_eps=1e-6,
                         fp32_mixing=fp32_mixing)
    hc.init_weights()
    leaves = [torch.randn(2, 8, n, d), torch.randn(2, 8, d), torch.rand(2, 8, n) * 2,
              mhc.sinkhorn(torch.randn(2, 8, n, n), iters=3, eps=1e-6)]
    dout = torch.randn(2, 8, n, d)

    def fwd_bwd(merge):
        inputs = [t.clone().requires_grad_() for t in leaves]
        out = merge(*inputs)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in inputs]

    eager = fwd_bwd(hc.merge)
    compiled, code = run_and_get_code(fwd_bwd, torch.compile(hc.merge, backend="inductor", fullgraph=True))
    assert "extern_kernels.bmm" not in "".join(code)
    for got, ref in zip(compiled, eager):  # FP32, summation order: 1e-5 of each tensor's largest element
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())

    def matmul_merge(residual, block_out, post, comb):
        return post.unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), residual)

    _, code = run_and_get_code(fwd_bwd, torch.compile(matmul_merge, backend="inductor", fullgraph=True))
    assert "extern_kernels.bmm" in "".join(code)
