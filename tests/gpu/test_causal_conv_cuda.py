"""CUDA (Triton) KDA short conv against the torch reference at the proxy's width (8,192 channels, 4 taps), through the
custom op and its autograd: packed documents and one document per row, BF16, FP16 and FP32, a BF16 weight, int32
positions; and a halo (context parallelism), which takes the reference on CUDA, against the CPU op."""

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


def test_other_dtypes_short_rows_and_int32_positions():
    """FP16 input, a BF16 weight (its gradient comes back in BF16), int32 positions, rows shorter than a tile."""
    for seqlen in (5, 70):
        x, w, pos, dy = _inputs(seqlen, 320, torch.float16, True, bsz=3)
        w, pos = w.bfloat16(), pos.int()
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = causal_conv_silu(xi, wi, pos)
        y.backward(dy)
        dx_ref, dw_ref, _ = causal_conv_silu_reference_bwd(dy, x, w, pos.long(), None)
        torch.testing.assert_close(y, causal_conv_silu_reference(x, w, pos.long(), None), rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(xi.grad, dx_ref, rtol=2e-3, atol=2e-3)
        assert wi.grad.dtype == torch.bfloat16
        torch.testing.assert_close(wi.grad, dw_ref, rtol=1.6e-2, atol=1e-2 * float(dw_ref.abs().max()))


def test_a_halo_on_cuda_equals_the_cpu_op():
    """With a halo (context parallelism) CUDA runs the torch reference: forward and gradients (x, weight, halo)
    equal the CPU op's, FP32."""
    x, w, pos, dy = _inputs(64, 256, torch.float32, True)
    halo = torch.randn(2, 1, 3, 256, device="cuda")
    outs = []
    for dev in ("cuda", "cpu"):
        leaves = [t.detach().to(dev).requires_grad_(True) for t in (x, w, halo)]
        y = causal_conv_silu(leaves[0], leaves[1], pos.to(dev), leaves[2])
        y.backward(dy.to(dev))
        outs.append([t.cpu() for t in (y, *(leaf.grad for leaf in leaves))])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
