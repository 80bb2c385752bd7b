"""ops/masked_attention.py: masked SDPA in causal query chunks computes the one-call function (fp32, forward and
gradients), and masked_keys_per_query counts the keys the chunks compute."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.models.glm5.args import ModelArgsError
from torchtitan_glm.models.glm5.dsa import DocLayout, causal_doc_mask
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops.masked_attention import masked_attention, masked_keys_per_query


def _selection_like_mask(bsz: int, seqlen: int) -> torch.Tensor:
    """Causal, two documents per row, a random half of each query's past (every query keeps itself)."""
    g = torch.Generator().manual_seed(0)
    doc = (torch.arange(seqlen) >= seqlen // 2 + 3).long().expand(bsz, seqlen)
    mask = causal_doc_mask(DocLayout(*doc_positions(doc, bsz, seqlen, torch.device("cpu"))))
    return mask & ((torch.rand(bsz, seqlen, seqlen, generator=g) < 0.5) | torch.eye(seqlen, dtype=torch.bool))


@pytest.mark.parametrize("chunk", [16, 50, 99, 100, 1000])
def test_causal_chunks_equal_one_call(chunk):
    """Chunks of 16 (exact), 50 (a short last chunk), 99, and 100 / 1000 (one call): output and dq, dk, dv equal
    one SDPA call under the whole mask."""
    seqlen = 100
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, seqlen, d, generator=g, dtype=torch.float64).float().requires_grad_()
               for d in (8, 8, 4))
    mask = _selection_like_mask(2, seqlen)
    grad_out = torch.randn(2, 3, seqlen, 4, generator=g)
    want_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=0.3)
    want = (want_out, *torch.autograd.grad(want_out, (q, k, v), grad_out))
    got_out = masked_attention(q, k, v, mask, scale=0.3, causal_chunk=chunk)
    got = (got_out, *torch.autograd.grad(got_out, (q, k, v), grad_out))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_chunks_compute_only_keys_up_to_their_last_query(monkeypatch):
    """Each SDPA call gets the keys up to its chunk's last query, and the counts match masked_keys_per_query."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q = k = v = torch.randn(1, 1, 10, 4)
    masked_attention(q, k, v, _selection_like_mask(1, 10), scale=1.0, causal_chunk=4)
    assert calls == [(4, 4), (4, 8), (2, 10)]
    assert masked_keys_per_query(10, 4) == (4 * 4 + 4 * 8 + 2 * 10) / 10
    assert masked_keys_per_query(10, 0) == masked_keys_per_query(10, 10) == 10
    assert masked_keys_per_query(4096, 1024) == 4096 * 5 / 8


def test_chunks_need_a_square_mask_and_a_valid_key():
    q, k, v = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 12, 4), torch.randn(1, 1, 12, 4)
    with pytest.raises(ValueError, match="causal_chunk needs as many queries as keys"):
        masked_attention(q, k, v, torch.ones(1, 8, 12, dtype=torch.bool), scale=1.0, causal_chunk=4)
    with pytest.raises(ModelArgsError, match="dsa_mask_query_chunk"):
        get_flavor("debug").replace(dsa_mask_query_chunk=-1)
