"""CUDA (FLA) path of the KDA op against the pure-torch reference and against FLA's public chunk_kda."""

import importlib.util

import pytest
import torch
import torch._dynamo

from torchtitan_glm.ops.kda import kda, kda_reference


def _fla_usable() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("fla") is None:
        return False
    try:
        import fla.ops.kda  # noqa: F401  (needs triton)
    except Exception:
        return False
    return True


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fla_usable(), reason="needs CUDA and fla-core with triton")]

DEV = "cuda"
# On a fresh machine FLA compiles and autotunes every Triton kernel per autotune key (H, K, V, tensor dtypes,
# and dense vs varlen, since cu_seqlens=None changes the key): several minutes per new combination on an H200.
# So the file keeps one head shape (H=4, K=V=128) and the default set to the production path (bf16,
# safe_gate=True, dense and varlen); fp32 inputs and unbounded gates (safe_gate=False) are marked slow.
H, D = 4, 128
SLOW = pytest.mark.slow
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
# FLA upstream (tests/ops/test_kda.py, fp16 vs naive_recurrent_kda): o 0.005, dq/dk/dv 0.008, dg/db 0.02 as an
# RMS error ratio. bf16 keeps 3 fewer mantissa bits than fp16, so its bounds are looser.
RMS_TOL = {
    torch.float32: dict(o=5e-3, dq=8e-3, dk=8e-3, dv=8e-3, dg=2e-2, dbeta=2e-2),
    torch.bfloat16: dict(o=1e-2, dq=2e-2, dk=2e-2, dv=2e-2, dg=4e-2, dbeta=4e-2),
}
MAX_TOL = {torch.float32: 2e-2, torch.bfloat16: 6e-2}  # max |diff| / max |ref|


def make_inputs(b, t, dtype, *, gate, seed=0, h=H, dk=D, dv=D):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(b, t, h, dk, device=DEV, generator=gen)
    k = torch.randn(b, t, h, dk, device=DEV, generator=gen)
    v = torch.randn(b, t, h, dv, device=DEV, generator=gen)
    if gate == "bounded":  # GLM's gate form: -5 * sigmoid(.), in (-5, 0)
        g = -5.0 * torch.sigmoid(2.0 * torch.randn(b, t, h, dk, device=DEV, generator=gen))
    elif gate == "uniform":  # in (-5, 0]; strong decay everywhere
        g = -5.0 * torch.rand(b, t, h, dk, device=DEV, generator=gen)
    else:  # unbounded logsigmoid gates
        g = torch.nn.functional.logsigmoid(torch.randn(b, t, h, dk, device=DEV, generator=gen))
    beta = torch.rand(b, t, h, device=DEV, generator=gen)
    do = torch.randn(b, t, h, dv, device=DEV, generator=gen)
    # q, k, v, beta in the compute dtype; g stays fp32 (the op contract)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)], do.to(dtype)


def value_and_grads(fn, inputs, do):
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    o = fn(*xs)
    return [o.detach(), *torch.autograd.grad(o, xs, do.to(o.dtype))]


def reference(inputs, do, seq_idx):
    """fp32 reference on the very same (possibly bf16-rounded) values."""
    return value_and_grads(lambda *x: kda_reference(*x, seq_idx), [x.float() for x in inputs], do.float())


def assert_close(got, want, dtype):
    for name, a, e in zip(NAMES, got, want):
        a, e = a.float(), e.float()
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        rms = ((a - e).square().mean().sqrt() / (e.square().mean().sqrt() + 1e-8)).item()
        mx = ((a - e).abs().max() / (e.abs().max() + 1e-8)).item()
        print(f"{name}: rms ratio {rms:.2e}, max-abs ratio {mx:.2e}")  # visible with -s
        assert rms < RMS_TOL[dtype][name], f"{name}: rms ratio {rms:.2e}"
        assert mx < MAX_TOL[dtype], f"{name}: max-abs ratio {mx:.2e}"


def seq_idx_for(b, lengths_per_row):
    rows = []
    for lengths in lengths_per_row:
        rows.append(torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]))
    return torch.stack(rows).to(DEV)


@pytest.mark.parametrize("dtype,gate,safe_gate", [
    pytest.param(torch.bfloat16, "bounded", True, id="bf16-bounded-safe"),
    pytest.param(torch.bfloat16, "uniform", True, id="bf16-uniform-safe"),
    pytest.param(torch.bfloat16, "logsigmoid", False, marks=SLOW, id="bf16-logsigmoid"),
    pytest.param(torch.float32, "bounded", True, marks=SLOW, id="fp32-bounded-safe"),
    pytest.param(torch.float32, "logsigmoid", False, marks=SLOW, id="fp32-logsigmoid"),
])
def test_fla_matches_reference(dtype, gate, safe_gate):
    inputs, do = make_inputs(2, 300, dtype, gate=gate)  # T not a multiple of 64
    got = value_and_grads(lambda *x: kda(*x, safe_gate=safe_gate), inputs, do)
    assert got[0].dtype == dtype and all(gr.dtype == x.dtype for gr, x in zip(got[1:], inputs))
    assert_close(got, reference(inputs, do, None), dtype)


@pytest.mark.parametrize("dtype,safe_gate", [
    pytest.param(torch.bfloat16, True, id="bf16-safe"),
    pytest.param(torch.bfloat16, False, marks=SLOW, id="bf16-unsafe"),
    pytest.param(torch.float32, True, marks=SLOW, id="fp32-safe"),
])
def test_fla_varlen_matches_reference(dtype, safe_gate):
    # Row 1 starts with row 0's last id (must restart at the row start); short (<16) and >64 documents.
    seq_idx = seq_idx_for(2, [[100, 13, 150, 37], [1, 64, 235]])
    seq_idx[1] += 3
    inputs, do = make_inputs(2, 300, dtype, gate="bounded", seed=1)
    got = value_and_grads(lambda *x: kda(*x, seq_idx, safe_gate=safe_gate), inputs, do)
    assert_close(got, reference(inputs, do, seq_idx), dtype)


@pytest.mark.parametrize("seq", [False, True], ids=["dense", "varlen"])
def test_fla_wrapper_equals_public_chunk_kda(seq):
    """Our use of FLA's internals reproduces FLA's public autograd entry point."""
    from fla.ops.kda import chunk_kda

    b, t, h, d = 2, 200, H, D
    inputs, do = make_inputs(b, t, torch.bfloat16, gate="bounded", seed=2)
    seq_idx = seq_idx_for(b, [[70, 130], [200]]) if seq else None
    got = value_and_grads(lambda *x: kda(*x, seq_idx, safe_gate=True), inputs, do)

    def public(q, k, v, g, beta):
        kw = dict(scale=d**-0.5, use_qk_l2norm_in_kernel=True, safe_gate=True)
        if seq_idx is None:
            return chunk_kda(q, k, v, g, beta, **kw)[0]
        cu = torch.tensor([0, 70, 200, 400], dtype=torch.long)
        flat = [x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
        o = chunk_kda(*flat, cu_seqlens=cu.to(DEV), cu_seqlens_cpu=cu, **kw)[0]
        return o.reshape(b, t, h, d)

    want = value_and_grads(public, inputs, do)
    for name, a, e in zip(NAMES, got, want):
        rms = ((a.float() - e.float()).square().mean().sqrt() / e.float().square().mean().sqrt()).item()
        assert rms < 1e-3, f"{name}: rms ratio {rms:.2e} vs public chunk_kda"


def test_cuda_opcheck():
    inputs, do = make_inputs(2, 80, torch.bfloat16, gate="bounded", seed=3)
    seq_idx = seq_idx_for(2, [[30, 50], [80]])
    xs = [x.clone().requires_grad_(True) for x in inputs]
    # Not test_aot_dispatch_dynamic for kda_fwd: it compares raw output values of two runs, and FLA allocates
    # the Aqk residual with torch.empty and writes only its causal part (the rest is never read), so those
    # entries differ run to run. Compiled-vs-eager agreement is covered by test_compile_fullgraph_cuda.
    torch.library.opcheck(torch.ops.torchtitan_glm.kda_fwd.default, (*xs, seq_idx, True, False),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    _, residuals = torch.ops.torchtitan_glm.kda_fwd(*inputs, seq_idx, True, False)
    torch.library.opcheck(torch.ops.torchtitan_glm.kda_bwd.default, (do, *inputs, seq_idx, residuals, True))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_cuda(backend):
    inputs, do = make_inputs(2, 150, torch.bfloat16, gate="bounded", seed=4)
    seq_idx = seq_idx_for(2, [[50, 100], [150]])

    def block(q, k, v, g, beta):
        o = kda(q * 1.5, k, v, g, beta, seq_idx, safe_gate=True)
        return o.float().tanh()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    got = value_and_grads(compiled, inputs, do.float())
    assert not torch._dynamo.utils.counters["graph_break"]
    want = value_and_grads(block, inputs, do.float())
    for name, a, e in zip(NAMES, got, want):
        rms = ((a.float() - e.float()).square().mean().sqrt() / e.float().square().mean().sqrt()).item()
        assert rms < 1e-2, f"{name}: compiled vs eager rms ratio {rms:.2e}"


def test_host_seq_idx_gives_the_same_varlen_layout_and_result():
    """seq_idx on the host (what the trainer passes: BatchLayout.kda_seq_idx) builds the same cu_seqlens and chunk
    table as FLA's own preparation, and the op's outputs and gradients equal those from a device seq_idx."""
    from fla.ops.utils.index import prepare_chunk_indices

    from torchtitan_glm.ops.kda import _FLA_CHUNK, _varlen

    seq_idx = seq_idx_for(2, [[100, 13, 150, 37], [1, 64, 235]])
    cu, cu_cpu, chunks = _varlen(seq_idx.cpu(), torch.device(DEV))
    assert cu.device.type == "cuda" and cu_cpu.device.type == "cpu"
    assert chunks.tolist() == prepare_chunk_indices(cu, _FLA_CHUNK, cu_seqlens_cpu=cu_cpu).tolist()
    inputs, do = make_inputs(2, 300, torch.bfloat16, gate="bounded", seed=5)
    on_host = value_and_grads(lambda *x: kda(*x, seq_idx.cpu(), safe_gate=True), inputs, do)
    on_device = value_and_grads(lambda *x: kda(*x, seq_idx, safe_gate=True), inputs, do)
    for name, a, e in zip(NAMES, on_host, on_device):  # same kernels and layout; not bitwise: FLA's backward
        rms = ((a.float() - e.float()).square().mean().sqrt() / e.float().square().mean().sqrt()).item()
        assert rms < 1e-3, f"{name}: host vs device seq_idx rms ratio {rms:.2e}"  # may reduce in any order


def test_save_states_gives_the_same_values_and_gradients():
    """activation_checkpoint.kda_disable_recompute: the backward reuses FLA's forward intermediates instead of
    recomputing them; values and gradients are those of the recomputing op, and of the reference."""
    inputs, do = make_inputs(2, 200, torch.bfloat16, gate="bounded", seed=6)
    saving = value_and_grads(lambda *x: kda(*x, None, safe_gate=True, save_states=True), inputs, do)
    recomputing = value_and_grads(lambda *x: kda(*x, None, safe_gate=True), inputs, do)
    for name, a, e in zip(NAMES, saving, recomputing):
        rms = ((a.float() - e.float()).square().mean().sqrt() / e.float().square().mean().sqrt()).item()
        assert rms < 2e-3, f"{name}: save_states vs recompute rms ratio {rms:.2e}"
    assert_close(saving, reference(inputs, do, None), torch.bfloat16)
    xs = [x.clone().requires_grad_(True) for x in inputs]
    # the fake implementation's residual shapes and dtypes against FLA's (test_faketensor)
    torch.library.opcheck(torch.ops.torchtitan_glm.kda_fwd.default, (*xs, None, True, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    _, residuals = torch.ops.torchtitan_glm.kda_fwd(*inputs, None, True, True)
    assert len(residuals) == 8
    torch.library.opcheck(torch.ops.torchtitan_glm.kda_bwd.default, (do, *inputs, None, residuals, True))


def test_save_states_compiles_whole():
    inputs, do = make_inputs(2, 150, torch.bfloat16, gate="bounded", seed=7)

    def block(q, k, v, g, beta):
        return kda(q * 1.5, k, v, g, beta, None, safe_gate=True, save_states=True).float().tanh()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got = value_and_grads(torch.compile(block, fullgraph=True, backend="inductor"), inputs, do.float())
    assert not torch._dynamo.utils.counters["graph_break"]
    want = value_and_grads(block, inputs, do.float())
    for name, a, e in zip(NAMES, got, want):
        rms = ((a.float() - e.float()).square().mean().sqrt() / e.float().square().mean().sqrt()).item()
        assert rms < 1e-2, f"{name}: compiled vs eager rms ratio {rms:.2e}"
