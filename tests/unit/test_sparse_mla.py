"""ops/sparse_mla.py: the tiled torch op against dense masked attention, gradcheck, the custom-op contract, and the
Triton kernels under the Triton interpreter (CPU) when triton is installed."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.interpret import run_interpreted
from torchtitan_glm.ops import sparse_mla as sm


def random_selection(doc_ids: torch.Tensor, k: int, *, seed: int, keep: float = 0.6) -> torch.Tensor:
    """[B, T, K] int32: for each query a random duplicate-free subset of its causal same-document tokens, -1 padding
    scattered through the row (not only at its end), sometimes no token at all."""
    gen = torch.Generator().manual_seed(seed)
    bsz, seqlen = doc_ids.shape
    out = torch.full((bsz, seqlen, k), -1, dtype=torch.int32)
    for b in range(bsz):
        for t in range(seqlen):
            allowed = [s for s in range(t + 1) if doc_ids[b, s] == doc_ids[b, t]]
            chosen = [s for s in allowed if torch.rand((), generator=gen) < keep][:k]
            if t % 7 == 3:
                chosen = []
            slots = torch.randperm(k, generator=gen)[: len(chosen)]
            out[b, t, slots] = torch.tensor(chosen, dtype=torch.int32)
    return out


def indices_to_mask(indices: torch.Tensor) -> torch.Tensor:
    bsz, seqlen, _ = indices.shape
    mask = torch.zeros(bsz, seqlen, seqlen + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(indices >= 0, indices.long(), seqlen), True)
    return mask[..., :seqlen]


def dense_masked(q, kv, mask, scale):
    """Dense reference: SDPA over the boolean mask, MQA (k = v = kv); queries without a key give 0."""
    qh = q.transpose(1, 2)
    kvh = kv.unsqueeze(1).expand(-1, q.shape[2], -1, -1)
    rows = mask.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(qh, kvh, kvh, attn_mask=(mask | ~rows).unsqueeze(1), scale=scale)
    return (out.transpose(1, 2) * rows.unsqueeze(-1)).contiguous()


def _case(seed=0, bsz=2, seqlen=37, heads=3, dim=10, k=9, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.arange(seqlen)
    doc_ids = torch.stack([(cuts >= int(0.4 * seqlen)).long() + (cuts >= int(0.75 * seqlen)).long(), 0 * cuts])[:bsz]
    q = torch.randn(bsz, seqlen, heads, dim, generator=gen, dtype=dtype)
    kv = torch.randn(bsz, seqlen, dim, generator=gen, dtype=dtype)
    return q, kv, random_selection(doc_ids, k, seed=seed)


@pytest.mark.parametrize("tile_elements", [None, 500])
def test_matches_dense_masked_attention_forward_and_gradients(monkeypatch, tile_elements):
    if tile_elements is not None:  # several query tiles (500 elements: 3 queries per tile here)
        monkeypatch.setattr(sm, "_TILE_ELEMENTS", tile_elements)
    q, kv, idx = _case()
    mask = indices_to_mask(idx)
    assert (~mask.any(-1)).any() and mask.any(-1).any()  # empty and non-empty rows
    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    q2, kv2 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = sm.sparse_mla(q1, kv1, idx, scale=0.37)
    ref = dense_masked(q2, kv2, mask, 0.37)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert out[~mask.any(-1)].abs().max() == 0, "a query with no index must output 0"
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(q1.grad, q2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv1.grad, kv2.grad, rtol=1e-5, atol=1e-5)


def test_lse_and_empty_rows():
    q, kv, idx = _case(seed=1)
    out, lse = torch.ops.torchtitan_glm.sparse_mla_fwd(q, kv, idx, 0.5)
    mask = indices_to_mask(idx)
    logits = torch.einsum("bthd,bsd->bths", q, kv) * 0.5
    want = logits.masked_fill(~mask[:, :, None], float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, want, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[~mask.any(-1)]).all()


def test_gradcheck_fp64():
    q, kv, idx = _case(seed=2, bsz=1, seqlen=9, heads=2, dim=4, k=4, dtype=torch.float64)
    q.requires_grad_()
    kv.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: sm.sparse_mla(a, b, idx, scale=0.7), (q, kv))


def test_custom_op_contract_and_compile():
    q, kv, idx = _case(seed=3, seqlen=16)
    q.requires_grad_()
    kv.requires_grad_()
    torch.library.opcheck(torch.ops.torchtitan_glm.sparse_mla_fwd.default, (q, kv, idx, 0.25))
    head_major = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # not copied by the op
    torch.library.opcheck(torch.ops.torchtitan_glm.sparse_mla_fwd.default, (head_major, kv, idx, 0.25))
    out = sm.sparse_mla(head_major, kv, idx, scale=0.25)
    assert out.stride() == head_major.stride()
    torch.testing.assert_close(out, sm.sparse_mla(q, kv, idx, scale=0.25), rtol=0, atol=0)
    compiled = torch.compile(lambda a, b, i: sm.sparse_mla(a, b, i, scale=0.25).square().sum(), fullgraph=True,
                             backend="aot_eager")
    loss = compiled(q, kv, idx)
    loss.backward()
    ref_q, ref_kv = q.detach().clone().requires_grad_(), kv.detach().clone().requires_grad_()
    sm.sparse_mla(ref_q, ref_kv, idx, scale=0.25).square().sum().backward()
    torch.testing.assert_close(q.grad, ref_q.grad)
    torch.testing.assert_close(kv.grad, ref_kv.grad)


def test_bad_shapes_name_the_tensor():
    q, kv, idx = _case()
    with pytest.raises(ValueError, match="indices"):
        sm.sparse_mla(q, kv, idx[:, :5], scale=1.0)
    with pytest.raises(ValueError, match="int32 or int64"):
        sm.sparse_mla(q, kv, idx.float(), scale=1.0)


_INTERPRET_SCRIPT = textwrap.dedent("""
    import torch
    from torchtitan_glm.ops.sparse_mla import sparse_mla_reference, sparse_mla_reference_bwd
    from torchtitan_glm.ops.sparse_mla_triton import sparse_mla_fwd_triton, sparse_mla_bwd_triton
    from tests.unit.test_sparse_mla import _case

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    # (shape, dtype, tolerance): fp16 stands in for bf16 (the interpreter has no bf16 matmul); H not a multiple of
    # BLOCK_H, D not a power of two, K not a multiple of BLOCK_K, empty rows, -1 padding inside rows.
    cases = [(dict(seqlen=21, heads=5, dim=24, k=9), torch.float32, 1e-5),
             (dict(seqlen=21, heads=17, dim=16, k=20), torch.float32, 1e-5),
             (dict(seqlen=21, heads=5, dim=24, k=9), torch.float16, 3e-3)]
    for shape, dtype, tol in cases:
        q, kv, idx = _case(seed=4, dtype=dtype, **shape)
        if dtype == torch.float16:  # a head-major q, as the absorbing einsum returns it: used in place
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        for cfg in (dict(BLOCK_H=16, BLOCK_K=16, num_warps=4, num_stages=1),
                    dict(BLOCK_H=32, BLOCK_K=32, num_warps=4, num_stages=1)):
            out, lse = sparse_mla_fwd_triton(q, kv, idx, scale=0.3, config=cfg)
            ref, ref_lse = sparse_mla_reference(q, kv, idx, scale=0.3)
            assert rel(out, ref) < tol, (shape, dtype, cfg, rel(out, ref))
            fin = torch.isfinite(ref_lse)
            assert torch.equal(fin, torch.isfinite(lse)) and (~fin).any()
            assert rel(lse[fin], ref_lse[fin].float()) < 1e-5
            do = torch.randn_like(q)
            dq, dkv = sparse_mla_bwd_triton(do, q, kv, idx, out, lse, scale=0.3, config=cfg)
            rdq, rdkv = sparse_mla_reference_bwd(do, q, kv, idx, ref, ref_lse, scale=0.3)
            assert rel(dq, rdq) < 3 * tol, (shape, dtype, cfg, "dq", rel(dq, rdq))
            assert rel(dkv, rdkv) < 3 * tol, (shape, dtype, cfg, "dkv", rel(dkv, rdkv))
    # the sparse KL's target: head-summed probabilities (H = 17 pads a 32-wide head block)
    from torchtitan_glm.ops.sparse_mla import _flat_indices, sparse_mla_head_probs_reference
    from torchtitan_glm.ops.sparse_mla_triton import sparse_mla_head_probs_triton
    for shape, dtype, tol in cases:
        q, kv, idx = _case(seed=6, dtype=dtype, **shape)
        n = q.shape[0] * q.shape[1]
        rows, kvr, gi = q.reshape(n, *q.shape[2:]), kv.reshape(-1, kv.shape[-1]), _flat_indices(idx, kv.shape[1])
        block_h = max(16, 1 << (shape["heads"] - 1).bit_length())
        got = sparse_mla_head_probs_triton(rows, kvr, gi, scale=0.3,
                                           config=dict(BLOCK_H=block_h, BLOCK_K=16, num_warps=4, num_stages=1))
        want = sparse_mla_head_probs_reference(rows, kvr, gi, scale=0.3)
        assert got.dtype == torch.float32 and (want.sum(-1) == 0).any(), "empty rows are in the case"
        assert rel(got, want) < tol, (shape, dtype, "head probs", rel(got, want))
        if shape["heads"] > 16:  # a block narrower than the heads is refused, not summed in part
            try:
                sparse_mla_head_probs_triton(rows, kvr, gi, scale=0.3,
                                             config=dict(BLOCK_H=16, BLOCK_K=16, num_warps=4, num_stages=1))
            except ValueError as e:
                assert "BLOCK_H >= H" in str(e), e
            else:
                raise AssertionError("BLOCK_H < H was not refused")
    # the 64-head backward needs a pipelined K loop under Triton 3.6 (ops/sparse_mla_triton.py::_bwd_config_faults)
    q, kv, idx = _case(seed=5, dtype=torch.float32, seqlen=21, heads=5, dim=24, k=40)
    wide = dict(BLOCK_H=64, BLOCK_K=16, num_warps=8, num_stages=2)
    narrow = dict(BLOCK_H=16, BLOCK_K=16, num_warps=4, num_stages=1)
    out, lse = sparse_mla_fwd_triton(q, kv, idx, scale=0.3, config=narrow)
    ref, ref_lse = sparse_mla_reference(q, kv, idx, scale=0.3)
    do = torch.randn_like(q)
    dq, dkv = sparse_mla_bwd_triton(do, q, kv, idx, out, lse, scale=0.3, config=wide)
    rdq, rdkv = sparse_mla_reference_bwd(do, q, kv, idx, ref, ref_lse, scale=0.3)
    assert rel(dq, rdq) < 3e-5 and rel(dkv, rdkv) < 3e-5, (rel(dq, rdq), rel(dkv, rdkv))
    for bad in (dict(wide, num_stages=1), dict(wide, BLOCK_K=32)):  # not pipelined; one iteration of K = 40
        try:
            sparse_mla_bwd_triton(do, q, kv, idx, out, lse, scale=0.3, config=bad)
        except ValueError as e:
            assert "faults" in str(e), e
        else:
            raise AssertionError(f"{bad} was not refused")
    print("TRITON_INTERPRET_OK")
""")


def test_triton_kernels_under_interpreter():
    """The Triton forward and backward against the torch reference, run by Triton's CPU interpreter."""
    pytest.importorskip("triton")
    res = run_interpreted("-c", _INTERPRET_SCRIPT)
    assert res.returncode == 0 and "TRITON_INTERPRET_OK" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
