"""The indexer KL's target on CUDA for BF16 attention inputs must be the FP32 computation's: the dense KL's logits as
TF32 matmuls (ops/indexer_kl.py::exact_tf32: BF16 values pass through TF32 unrounded), the sparse KL's head-summed
probabilities from a Triton kernel (ops/sparse_mla.py::sparse_mla_head_probs)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_indexer_ops import Layout, _doc_ids, _selection, untiled_scores
from torchtitan_glm.ops.indexer_kl import exact_tf32, indexer_kl_dense, indexer_kl_sparse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ, KPOOL, SCALE = 300, 4, 512**-0.5


def _case(seed: int):
    lay = Layout(_doc_ids(SEQ), KPOOL)
    gen = torch.Generator().manual_seed(seed)
    slots = lay.pools.start.shape[1]
    q, w = torch.randn(2, SEQ, 8, 64, generator=gen), torch.randn(2, SEQ, 8, generator=gen)
    pk = torch.randn(2, slots, 64, generator=gen)
    aq, akv = torch.randn(2, SEQ, 16, 512, generator=gen), torch.randn(2, SEQ, 512, generator=gen)
    return lay, q, w, pk, aq, akv


def _dense(lay, q, w, pk, aq, akv):
    c = lambda x: x.cuda()  # noqa: E731
    return indexer_kl_dense(c(q), c(w), c(pk), c(lay.pools.start), c(lay.last), c(lay.pools.key), c(lay.doc.key),
                            aq, akv, SCALE, KPOOL, 64, True)


def _sparse(lay, q, w, pk, aq, akv, pool_ids, indices):
    c = lambda x: x.cuda()  # noqa: E731
    return indexer_kl_sparse(c(q), c(w), c(pk), c(pool_ids), aq, akv, c(indices), SCALE, KPOOL, 64, True)


def _close(a, b, rtol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=rtol * y.abs().max().item())


def test_tf32_target_equals_fp32_for_bf16_inputs():
    lay, q, w, pk, aq, akv = _case(0)
    aq16, akv16 = aq.bfloat16().cuda(), akv.bfloat16().cuda()
    pool_ids, indices = _selection(lay, untiled_scores(q, w, pk), 16)
    # BF16 inputs take TF32; the same values as FP32 tensors take IEEE FP32
    _close(_dense(lay, q, w, pk, aq16, akv16), _dense(lay, q, w, pk, aq16.float(), akv16.float()), 1e-5)
    _close(_sparse(lay, q, w, pk, aq16, akv16, pool_ids, indices),
           _sparse(lay, q, w, pk, aq16.float(), akv16.float(), pool_ids, indices), 1e-5)


def test_tf32_is_engaged():
    """The check above would pass with TF32 off: show that the context does switch matmuls to TF32 (values that are
    not BF16 are rounded, so the result moves), and that it restores the setting."""
    a, b = torch.randn(256, 512, device="cuda"), torch.randn(512, 256, device="cuda")
    before = torch.backends.cuda.matmul.fp32_precision
    ieee = a @ b
    with exact_tf32(True):
        tf32 = a @ b
        exact = a.bfloat16().float() @ b.bfloat16().float()
    assert torch.backends.cuda.matmul.fp32_precision == before
    assert (tf32 - ieee).abs().max() > 1e-4 * ieee.abs().max()
    torch.testing.assert_close(exact, a.bfloat16().float() @ b.bfloat16().float(), rtol=1e-5, atol=1e-4)
