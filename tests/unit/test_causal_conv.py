"""The KDA short conv op (ops/causal_conv.py): forward and gradients against an fp64 windowed reference (documents,
halos, tokens fewer than taps, channel chunks), gradcheck, that backward holds no FP32 copy, and the Triton kernels
against the torch reference under Triton's CPU interpreter."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.interpret import run_interpreted
from tests.saved import saved_for_backward
from torchtitan_glm.models.glm5 import layers
from torchtitan_glm.ops.causal_conv import causal_conv_silu


def _reference(x, w, pos, halo):
    """silu(sum_j [pos_t >= j] x_{t-j} w[:, W-1-j]) in fp64 from explicit W-token windows (unfold)."""
    bsz, seqlen, ch = x.shape
    kernel = w.shape[1]
    slots = 1 if halo is None else halo.shape[1]
    seq = x.double().reshape(bsz, slots, seqlen // slots, ch)
    before = (torch.zeros(bsz, slots, kernel - 1, ch, dtype=torch.float64) if halo is None else halo.double())
    seq = torch.cat([before, seq], dim=2)
    win = seq.unfold(2, kernel, 1)  # [B, P, L, C, W]: window t holds x_{t-W+1} .. x_t
    lag = torch.arange(kernel - 1, -1, -1)  # window slot i holds x_{t - lag[i]}
    if pos is not None:
        keep = (pos.reshape(bsz, slots, -1, 1, 1) >= lag).double()
        win = win * keep
    out = (win * w.double()).sum(-1).reshape(bsz, seqlen, ch)
    return F.silu(out)


def _case(seed, *, bsz=2, seqlen=24, ch=10, kernel=4, slots=0, docs=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bsz, seqlen, ch, generator=g).to(dtype)
    w = torch.randn(ch, kernel, generator=g) * 0.5
    pos = None
    if docs:
        starts = torch.zeros(bsz, seqlen, dtype=torch.bool)
        starts[:, 0] = True
        starts[0, 5] = starts[0, 6] = True  # a one-token document
        starts[-1, seqlen // 2 + 1] = True  # a restart mid-slot
        idx = torch.arange(seqlen).expand(bsz, -1)
        last_start = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
        pos = idx - last_start
        if slots:  # positions continue into the halo's document (a global position under CP)
            pos = pos + 2 * (~starts.cumsum(1).gt(1)).long()
    halo = None if not slots else torch.randn(bsz, slots, kernel - 1, ch, generator=g).to(dtype)
    return x, w, pos, halo


@pytest.mark.parametrize("slots", [0, 1, 3])
@pytest.mark.parametrize("docs", [False, True])
def test_forward_and_gradients_match_fp64_windows(slots, docs, monkeypatch):
    monkeypatch.setattr(layers, "BWD_CHUNK_ELEMENTS", 24 * 2 * 3)  # 3 channels per backward chunk
    x, w, pos, halo = _case(0, slots=slots, docs=docs)
    x.requires_grad_(True)
    w.requires_grad_(True)
    if halo is not None:
        halo.requires_grad_(True)
    y = causal_conv_silu(x, w, pos, halo)
    leaves = [t for t in (x, w, halo) if t is not None]
    want_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    want = _reference(want_leaves[0], want_leaves[1], pos, want_leaves[2] if halo is not None else None)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.dtype)
    got = torch.autograd.grad(y, leaves, dy)
    expect = torch.autograd.grad(want, want_leaves, dy.double())
    for name, a, b in zip(("x", "w", "halo"), got, expect):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6 * float(b.abs().max()), msg=name)


def test_fewer_tokens_than_taps_per_slot():
    """Two tokens per slot with a 4-tap kernel: the halo feeds taps past the slot's start."""
    x, w, pos, halo = _case(1, seqlen=4, slots=2, docs=False)
    for t in (x, w, halo):
        t.requires_grad_(True)
    y = causal_conv_silu(x, w, None, halo)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, halo)]
    want = _reference(leaves[0], leaves[1], None, leaves[2])
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.dtype)
    for a, b in zip(torch.autograd.grad(y, (x, w, halo), dy), torch.autograd.grad(want, leaves, dy.double())):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def test_gradcheck_fp64():
    x, w, pos, halo = _case(2, bsz=1, seqlen=8, ch=3, kernel=3, slots=2)
    args = (x.double().requires_grad_(True), w.double().requires_grad_(True), pos,
            halo.double().requires_grad_(True))
    assert torch.autograd.gradcheck(causal_conv_silu, args)


def test_bf16_input_keeps_no_fp32_copy_for_backward():
    """What autograd holds for backward: the BF16 input, the FP32 weight, the positions, nothing of [T, C] in FP32
    (the plain expression kept W-1 FP32 shifted taps)."""
    x, w, pos, _ = _case(3, seqlen=64, ch=16, dtype=torch.bfloat16)
    x.requires_grad_(True)
    w.requires_grad_(True)
    with saved_for_backward() as held:
        y = causal_conv_silu(x, w, pos)
    big_fp32 = [t for t in held if t.dtype == torch.float32 and t.numel() >= x.numel()]
    assert not big_fp32, [tuple(t.shape) for t in big_fp32]
    assert any(t.dtype == torch.bfloat16 and t.shape == x.shape for t in held)
    y.float().square().sum().backward()  # and the BF16 case runs its backward
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("with_docs", [False, True])
def test_compiled_keeps_no_fp32_copy_for_backward_and_equals_eager(with_docs):
    """Under torch.compile (inductor) too: compiled as the plain expression, AOTAutograd's partitioner kept three FP32
    [B, T, C] intermediates for the backward; the opaque op keeps its inputs. Compiled runs the same kernels as
    eager, so output and gradients are bit-identical."""
    x, w, pos, _ = _case(4, seqlen=64, ch=32, dtype=torch.bfloat16)
    pos = pos if with_docs else None
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: causal_conv_silu(x, w, pos) * 2, fullgraph=True)
    runs = []
    for fn in (lambda x, w: causal_conv_silu(x, w, pos) * 2, compiled):
        xi, wi = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with saved_for_backward() as held:
            y = fn(xi, wi)
        y.float().square().sum().backward()
        runs.append((y, xi.grad, wi.grad, held))
    (y0, dx0, dw0, _), (y1, dx1, dw1, held) = runs
    big_fp32 = [tuple(t.shape) for t in held if t.dtype == torch.float32 and t.numel() >= x.numel()]
    assert not big_fp32, big_fp32
    for a, b in ((y1, y0), (dx1, dx0), (dw1, dw0)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_with_a_halo_keeps_its_inputs_and_matches_eager():
    """Under context parallelism (a halo) a compiled block runs the conv as a checkpointed plain expression (one fused
    kernel on CUDA): autograd keeps no FP32 [B, T, C] tensor and no conv output, and values match the eager op."""
    x, w, pos, halo = _case(10, seqlen=64, ch=32, slots=2, dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w, h: causal_conv_silu(x, w, pos, h) * 2, fullgraph=True)
    runs = []
    for fn in (lambda x, w, h: causal_conv_silu(x, w, pos, h) * 2, compiled):
        xi, wi, hi = (t.clone().requires_grad_(True) for t in (x, w, halo))
        with saved_for_backward() as held:
            y = fn(xi, wi, hi)
        y.float().square().sum().backward()
        runs.append((y, xi.grad, wi.grad, hi.grad, held))
    big = [(tuple(t.shape), t.dtype) for t in runs[1][4] if t.numel() >= x.numel()]
    assert big == [(tuple(x.shape), torch.bfloat16)], big  # x alone: no conv output, nothing in FP32
    graphs = []
    torch._dynamo.reset()
    torch.compile(lambda x, w, h: causal_conv_silu(x, w, pos, h), fullgraph=True,
                  backend=lambda gm, _: graphs.append(gm) or gm.forward)(x.requires_grad_(True), w, halo)
    ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("tag_activation_checkpoint" in o for o in ops) and not any("causal_conv_silu_fwd" in o for o in ops)
    for a, b in zip(runs[1][:4], runs[0][:4]):  # BF16 outputs: FP32 sums fused in another order, rounded once
        torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1e-5 * float(b.abs().max()) + 1e-2)


def test_custom_ops_pass_opcheck():
    """Fake kernels, schemas and the registered autograd agree with the CPU kernels (torch.library.opcheck)."""
    x, w, pos, halo = _case(6, seqlen=12, slots=2)
    for h in (None, halo):
        args = (x.clone().requires_grad_(True), w.clone().requires_grad_(True), pos, h)
        torch.library.opcheck(torch.ops.torchtitan_glm.causal_conv_silu_fwd.default, args)


_INTERPRET_SCRIPT = textwrap.dedent("""
    import torch
    from torchtitan_glm.ops.causal_conv import causal_conv_silu_reference, causal_conv_silu_reference_bwd
    from torchtitan_glm.ops.causal_conv_triton import (_BWD_CONFIGS, _FWD_CONFIGS, causal_conv_silu_bwd_triton,
                                                       causal_conv_silu_fwd_triton)
    from tests.unit.test_causal_conv import _case

    # every config (the autotuner needs a GPU); T not a multiple of any config's BT, C not one of BD; documents
    # and none; kernel widths 4, 3, 2 and 1
    cases = [(70, 200, 4, True, torch.float32), (70, 200, 4, False, torch.float32), (33, 130, 2, True, torch.float32),
             (70, 200, 4, True, torch.bfloat16), (37, 72, 3, True, torch.float32), (21, 40, 1, True, torch.float32)]
    configs = [dict(f.kwargs, num_warps=f.num_warps) for f in _FWD_CONFIGS]
    bwd_configs = [dict(b.kwargs, num_warps=b.num_warps) for b in _BWD_CONFIGS]
    configs = [(configs[i % len(configs)], bwd_configs[i % len(bwd_configs)])
               for i in range(max(len(configs), len(bwd_configs)))]
    for (seqlen, ch, kernel, docs, dtype), (config, bwd_config) in [(case, c) for case in cases for c in configs]:
        x, w, pos, _ = _case(7, bsz=2, seqlen=seqlen, ch=ch, kernel=kernel, docs=docs, dtype=dtype)
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
        y = causal_conv_silu_fwd_triton(x, w, pos, config=config)
        dx, dw = causal_conv_silu_bwd_triton(dy, x, w, pos, config=bwd_config)
        y_ref = causal_conv_silu_reference(x, w, pos, None)
        dx_ref, dw_ref, _ = causal_conv_silu_reference_bwd(dy, x, w, pos, None)
        # FP32: the sums' order and FMA contraction; BF16: one rounding of the output
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(dx, dx_ref, **tol)
        torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-4 * float(dw_ref.abs().max()))
        assert y.dtype == dx.dtype == dtype and dw.dtype == torch.float32 and dw.shape == w.shape
    # one backward program over a whole row of several tiles (as at long T, where a program takes 128+ tokens)
    import torchtitan_glm.ops.causal_conv_triton as kernels
    max_splits, kernels._MAX_SPLITS = kernels._MAX_SPLITS, 1
    x, w, pos, _ = _case(9, bsz=2, seqlen=150, ch=70)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    dx, dw = causal_conv_silu_bwd_triton(dy, x, w, pos, config=dict(BT=16, BD=128, num_warps=4))
    dx_ref, dw_ref, _ = causal_conv_silu_reference_bwd(dy, x, w, pos, None)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-4 * float(dw_ref.abs().max()))
    kernels._MAX_SPLITS = max_splits
    for bad in (lambda: causal_conv_silu_fwd_triton(x.transpose(1, 2).contiguous().transpose(1, 2), w, pos),
                lambda: causal_conv_silu_fwd_triton(x, w, pos[:1]),
                lambda: causal_conv_silu_fwd_triton(x, torch.randn(x.shape[-1], kernels.MAX_TAPS + 1), pos),
                lambda: causal_conv_silu_bwd_triton(dy, x, w, pos, config=dict(BT=128, BD=128, num_warps=4))):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("a layout the kernels cannot index was accepted")
    # a two-tap conv reads only x_t and x_{t-1}: an inf three tokens back leaves the output finite, as in the
    # reference (the unrolled taps past W are not computed, not multiplied by zero)
    x, w, pos, _ = _case(11, bsz=1, seqlen=20, ch=16, kernel=2, docs=False)  # the reference masks by product
    x[0, 5, 3] = float("inf")
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(8))
    y = causal_conv_silu_fwd_triton(x, w, pos, config=configs[0][0])
    dx, _ = causal_conv_silu_bwd_triton(dy, x, w, pos, config=configs[0][1])
    dx_ref, _, _ = causal_conv_silu_reference_bwd(dy, x, w, pos, None)
    assert torch.equal(y.isfinite(), causal_conv_silu_reference(x, w, pos, None).isfinite()) and y[0, 8, 3].isfinite()
    assert torch.equal(dx.isfinite(), dx_ref.isfinite())
    print("TRITON_INTERPRET_OK")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.long
def test_triton_kernels_under_interpreter():
    """The Triton forward and backward against the torch reference, run by Triton's CPU interpreter."""
    res = run_interpreted("-c", _INTERPRET_SCRIPT)
    assert res.returncode == 0 and "TRITON_INTERPRET_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_convs_wider_than_the_kernels_take_the_reference():
    """The Triton kernels unroll four taps: a five-tap conv, a halo or positions of another shape take the torch
    reference on CUDA too (the decision alone; tests/gpu/test_causal_conv_cuda.py runs both paths)."""
    from torchtitan_glm.ops.causal_conv import _use_triton
    from torchtitan_glm.ops.causal_conv_triton import MAX_TAPS

    x, w, pos, halo = _case(3, slots=1)
    assert MAX_TAPS == 4 and _use_triton(x, w, pos, None) and _use_triton(x, w, None, None)
    assert not _use_triton(x, torch.randn(x.shape[-1], MAX_TAPS + 1), pos, None)
    assert not _use_triton(x, w, pos, halo)
    assert not _use_triton(x, w, pos[:1], None)
