"""CUDA (Triton) KDA short conv against the torch reference at the proxy's width (8,192 channels, 4 taps), through the
custom op and its autograd: packed documents and one document per row, BF16 and FP32; and a halo (context
parallelism) still takes the reference on CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from torchtitan_glm.ops.causal_conv import (causal_conv_silu, causal_conv_silu_reference,
                                            causal_conv_silu_reference_bwd)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and triton")]


def _inputs(seqlen: int, ch: int, dtype: torch.dtype, docs: bool, bsz: int = 2):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(bsz, seqlen, ch, device="cuda", generator=gen).to(dtype)
    w = torch.randn(ch, 4, device="cuda", generator=gen) * 0.5
    pos = None
    if docs:  # documents of random lengths, restarting at random tokens
        starts = torch.rand(bsz, seqlen, device="cuda", generator=gen) < 0.01
        starts[:, 0] = True
        idx = torch.arange(seqlen, device="cuda").expand(bsz, -1)
        pos = idx - torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    dy = torch.randn(x.shape, device="cuda", generator=gen).to(dtype)
    return x, w, pos, dy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("docs", [True, False])
def test_triton_matches_reference(dtype, docs):
    x, w, pos, dy = _inputs(4099, 8192, dtype, docs)
    xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = causal_conv_silu(xi, wi, pos)
    y.backward(dy)
    y_ref = causal_conv_silu_reference(x, w, pos, None)
    dx_ref, dw_ref, _ = causal_conv_silu_reference_bwd(dy, x, w, pos, None)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(xi.grad, dx_ref, **tol)
    # dw sums 8,198 products per channel and tap: FP32 in both, in another order
    torch.testing.assert_close(wi.grad, dw_ref, rtol=1e-4, atol=1e-5 * float(dw_ref.abs().max()))
    if dtype == torch.bfloat16:  # most outputs round to the reference's BF16 value
        assert (y == y_ref).float().mean() > 0.99


def test_halo_takes_the_reference_on_cuda():
    x, w, pos, dy = _inputs(64, 256, torch.bfloat16, True)
    halo = torch.randn(2, 1, 3, 256, device="cuda", dtype=torch.bfloat16)
    y = causal_conv_silu(x, w, pos, halo)
    torch.testing.assert_close(y, causal_conv_silu_reference(x, w, pos, halo), rtol=0, atol=0)
