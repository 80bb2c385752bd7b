"""CUDA (Triton) sparse MLA against the tiled torch reference at GLM-5.3-Flash's shapes (H=64, D=512, K=2051), and the
proxy's DSA layer compiled with inductor on the sparse path."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from torchtitan_glm.ops.sparse_mla import sparse_mla, sparse_mla_reference, sparse_mla_reference_bwd

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and triton")]

H, D, K = 64, 512, 2051
SCALE = 256**-0.5  # qk_head_dim^-1/2


def causal_selection(seqlen: int, k: int, *, seed: int) -> torch.Tensor:
    """[1, T, K] int32: per query k distinct random tokens <= t (all of them when t < k), -1 padding (T < k too)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.full((1, seqlen, k), -1, dtype=torch.int32, device="cuda")
    kk = min(k, seqlen)
    for s in range(0, seqlen, 1024):  # [1024, T] random keys at a time
        t = torch.arange(s, min(s + 1024, seqlen), device="cuda")
        r = torch.rand(t.numel(), seqlen, generator=gen, device="cuda")
        r = r.masked_fill(torch.arange(seqlen, device="cuda")[None, :] > t[:, None], -1.0)
        top = r.topk(kk, dim=-1)
        out[0, s:s + t.numel(), :kk] = torch.where(top.values >= 0, top.indices, -1).int()
    return out


def _inputs(seqlen: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, seqlen, H, D, generator=gen, device="cuda").to(dtype)
    kv = torch.randn(1, seqlen, D, generator=gen, device="cuda").to(dtype)
    return q, kv, causal_selection(seqlen, K, seed=seed)


def _rms_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).square().mean().sqrt() / b.float().square().mean().sqrt()).item()


def _max_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("seqlen", [4096, 8192])
def test_triton_matches_reference_bf16(seqlen):
    q, kv, idx = _inputs(seqlen, torch.bfloat16)
    q.requires_grad_()
    kv.requires_grad_()
    out = sparse_mla(q, kv, idx, scale=SCALE)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    with torch.no_grad():
        ref, lse = sparse_mla_reference(q, kv, idx, scale=SCALE)
        rdq, rdkv = sparse_mla_reference_bwd(dout, q, kv, idx, ref, lse, scale=SCALE)
    # BF16 inputs, FP32 accumulation; the kernel rounds P and dS to BF16 for the tensor-core products.
    for name, got, want, rms in (("out", out, ref, 1e-2), ("dq", dq, rdq, 2e-2), ("dkv", dkv, rdkv, 2e-2)):
        assert _rms_ratio(got, want) < rms, (name, _rms_ratio(got, want))
        assert _max_ratio(got, want) < 5 * rms, (name, _max_ratio(got, want))


def test_fp32_takes_the_reference():
    q, kv, idx = _inputs(512, torch.float32, seed=1)
    out, lse = torch.ops.torchtitan_glm.sparse_mla_fwd(q, kv, idx, SCALE)
    ref, ref_lse = sparse_mla_reference(q, kv, idx, scale=SCALE)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_triton_lse_empty_rows_and_head_major_bf16():
    q, kv, idx = _inputs(2048, torch.bfloat16, seed=1)
    idx[0, 100] = -1  # a query without any token
    out, lse = torch.ops.torchtitan_glm.sparse_mla_fwd(q, kv, idx, SCALE)
    ref, ref_lse = sparse_mla_reference(q.float(), kv.float(), idx, scale=SCALE)
    assert _rms_ratio(out, ref) < 1e-2 and out[0, 100].abs().max() == 0
    assert torch.isneginf(lse[0, 100]).all()
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    torch.testing.assert_close(lse[fin], ref_lse[fin], rtol=1e-3, atol=1e-3)  # FP32 logits of BF16 inputs
    dout = torch.randn_like(out)
    dq, dkv = torch.ops.torchtitan_glm.sparse_mla_bwd(dout, q, kv, idx, out, lse, SCALE)
    rdq, rdkv = sparse_mla_reference_bwd(dout.float(), q.float(), kv.float(), idx, ref, ref_lse, scale=SCALE)
    assert _rms_ratio(dq, rdq) < 2e-2 and _rms_ratio(dkv, rdkv) < 2e-2
    assert dq[0, 100].abs().max() == 0
    # A head-major q (the absorbing einsum's layout) is read in place; out and dq come back in that layout.
    hq = q.transpose(1, 2).contiguous().transpose(1, 2)
    hout, hlse = torch.ops.torchtitan_glm.sparse_mla_fwd(hq, kv, idx, SCALE)
    hdq, hdkv = torch.ops.torchtitan_glm.sparse_mla_bwd(dout.transpose(1, 2).contiguous().transpose(1, 2), hq, kv, idx,
                                                        hout, hlse, SCALE)
    assert hout.stride() == hq.stride() and hdq.stride() == hq.stride()
    assert _rms_ratio(hout, out) < 1e-3 and torch.equal(torch.isfinite(hlse), torch.isfinite(lse))
    assert _rms_ratio(hdq, dq) < 1e-3 and _rms_ratio(hdkv, dkv) < 1e-3  # dkv's atomic adds reorder


def test_head_major_offsets_past_2_31_elements():
    """A head-major q at T = 70,000 puts head 63 at 63 * T * D ~ 2.26e9 elements from its base: the kernels' head
    offsets must be 64-bit (with 32-bit ones the proxy's 128K step hit an illegal memory access, 2026-12-04). Few
    keys per query keep it quick; the queries checked sit at the end, in the last heads."""
    t_len, k = 70_000, 16
    gen = torch.Generator(device="cuda").manual_seed(3)
    hq = torch.randn(1, H, t_len, D, generator=gen, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kv = torch.randn(1, t_len, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t_len, device="cuda")
    idx = (pos[:, None] - torch.arange(k, device="cuda")[None, :]).clamp(min=-1).int()[None]  # the last k tokens
    out, lse = torch.ops.torchtitan_glm.sparse_mla_fwd(hq, kv, idx, SCALE)
    dout = torch.randn(out.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    dq, dkv = torch.ops.torchtitan_glm.sparse_mla_bwd(dout, hq, kv, idx, out, lse, SCALE)
    tail = slice(t_len - 64, t_len)
    q_t = hq[:, tail].float()
    ref, ref_lse = sparse_mla_reference(q_t, kv.float(), idx[:, tail], scale=SCALE)
    assert _rms_ratio(out[:, tail], ref) < 1e-2
    rdq, _ = sparse_mla_reference_bwd(dout[:, tail].float(), q_t, kv.float(), idx[:, tail], ref, ref_lse, scale=SCALE)
    assert _rms_ratio(dq[:, tail], rdq) < 2e-2
    assert torch.isfinite(dkv.float()).all()


@pytest.mark.parametrize("k", [16, 24, 32, 48])
def test_backward_at_small_k(k):
    """At K < 2 * BLOCK_K the 64-head backward configs fault under Triton 3.6 (ops/sparse_mla_triton.py::
    _bwd_config_faults, seen on the H200 at K = 16): the autotuner must offer only configs that run, and they must
    match the reference."""
    seqlen = 2048
    q, kv, _ = _inputs(seqlen, torch.bfloat16, seed=k)
    pos = torch.arange(seqlen, device="cuda")
    idx = (pos[:, None] - torch.arange(k, device="cuda")[None, :]).clamp(min=-1).int()[None]  # the last k tokens
    out, lse = torch.ops.torchtitan_glm.sparse_mla_fwd(q, kv, idx, SCALE)
    dout = torch.randn_like(out)
    dq, dkv = torch.ops.torchtitan_glm.sparse_mla_bwd(dout, q, kv, idx, out, lse, SCALE)
    torch.cuda.synchronize()
    ref, ref_lse = sparse_mla_reference(q, kv, idx, scale=SCALE)
    rdq, rdkv = sparse_mla_reference_bwd(dout, q, kv, idx, ref, ref_lse, scale=SCALE)
    assert _rms_ratio(dq, rdq) < 1e-2 and _rms_ratio(dkv, rdkv) < 1e-2


@pytest.mark.parametrize("k", [19, K])
def test_head_probs_triton_matches_reference(k):
    """The sparse indexer KL's target (ops/sparse_mla.py::sparse_mla_head_probs): the Triton kernel on BF16 against
    the torch reference on the same values in FP32 (BF16 products are exact in FP32, so only sums differ)."""
    from torchtitan_glm.ops.sparse_mla import _flat_indices, sparse_mla_head_probs, sparse_mla_head_probs_reference

    seqlen = 2048
    q, kv, idx = _inputs(seqlen, torch.bfloat16, seed=k)
    if k != K:
        pos = torch.arange(seqlen, device="cuda")
        idx = (pos[:, None] - torch.arange(k, device="cuda")[None, :]).clamp(min=-1).int()[None]
    rows, kvr, gi = q.reshape(seqlen, H, D), kv.reshape(seqlen, D), _flat_indices(idx, seqlen)
    got = sparse_mla_head_probs(rows, kvr, gi, scale=SCALE)
    want = sparse_mla_head_probs_reference(rows.float(), kvr.float(), gi, scale=SCALE)
    assert got.dtype == torch.float32 and got.shape == (seqlen, k)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * H)
    torch.testing.assert_close(got.sum(-1), torch.full_like(got[:, 0], float(H)), rtol=1e-4, atol=0)  # H softmaxes


def test_deterministic_mode_uses_the_reference_backward(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses deterministic mode without it
    q, kv, idx = _inputs(1024, torch.bfloat16, seed=2)
    out, lse = torch.ops.torchtitan_glm.sparse_mla_fwd(q, kv, idx, SCALE)
    dout = torch.randn_like(out)
    torch.use_deterministic_algorithms(True)
    try:
        first = torch.ops.torchtitan_glm.sparse_mla_bwd(dout, q, kv, idx, out, lse, SCALE)
        second = torch.ops.torchtitan_glm.sparse_mla_bwd(dout, q, kv, idx, out, lse, SCALE)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_proxy_dsa_layer_compiles_and_trains_on_the_sparse_path():
    from torchtitan_glm.models.glm5 import get_flavor
    from torchtitan_glm.models.glm5.batch import BatchLayout
    from torchtitan_glm.models.glm5.dsa import DocLayout, SparseMLA
    from torchtitan_glm.models.glm5.seqinfo import doc_positions

    torch.manual_seed(0)
    args = get_flavor("glm5_3_flash_proxy")
    with torch.device("cuda"):
        attn = SparseMLA(args)
        attn.init_weights()
    attn.to(torch.bfloat16)
    seqlen = 8192
    doc_ids = (torch.arange(seqlen, device="cuda") >= 5000).long().unsqueeze(0)
    doc = DocLayout(*doc_positions(doc_ids, 1, seqlen, torch.device("cuda")))
    x = torch.randn(1, seqlen, args.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(attn, fullgraph=True)
    out, indices, stats = compiled(x, BatchLayout(doc, doc_ids, None, "sparse"))
    assert indices.shape == (1, seqlen, args.index_topk + args.index_kpool - 1)
    (out.float().square().mean() + stats.kl_sum / stats.rows).backward()
    assert torch.isfinite(out).all() and stats.kl_sum > 0 and stats.rows > seqlen - 10
    grads = {n: p.grad for n, p in attn.named_parameters() if p.requires_grad}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["indexer.wq_b.weight"].abs().max() > 0 and grads["kv_b_proj.weight"].abs().max() > 0
