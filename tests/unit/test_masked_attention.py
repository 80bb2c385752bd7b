"""ops/masked_attention.py: masked SDPA in causal query chunks, and after plain causal rows, computes the one-call
function (fp32, forward and gradients), and masked_keys_per_query counts the keys each part computes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.models.glm5.args import ModelArgsError
from torchtitan_glm.models.glm5.dsa import DocLayout, causal_doc_mask
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops.masked_attention import masked_attention, masked_keys_per_query


def _selection_like_mask(bsz: int, seqlen: int, causal_rows: int = 0) -> torch.Tensor:
    """Causal, a random half of each query's past (every query keeps itself); two documents per row, or with
    causal_rows one document whose first causal_rows rows keep their whole past (as DSA's first queries do)."""
    g = torch.Generator().manual_seed(0)
    doc = None if causal_rows else (torch.arange(seqlen) >= seqlen // 2 + 3).long().expand(bsz, seqlen)
    mask = causal_doc_mask(DocLayout(*doc_positions(doc, bsz, seqlen, torch.device("cpu"))))
    keep = (torch.rand(bsz, seqlen, seqlen, generator=g) < 0.5) | torch.eye(seqlen, dtype=torch.bool)
    keep[:, :causal_rows] = True
    return mask & keep


def _grads_equal_one_call(mask: torch.Tensor, seqlen: int, **kw) -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, seqlen, d, generator=g, dtype=torch.float64).float().requires_grad_()
               for d in (8, 8, 4))
    grad_out = torch.randn(2, 3, seqlen, 4, generator=g)
    want_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=0.3)
    want = (want_out, *torch.autograd.grad(want_out, (q, k, v), grad_out))
    got_out = masked_attention(q, k, v, None if kw.get("causal_rows", 0) >= seqlen else mask, scale=0.3, **kw)
    got = (got_out, *torch.autograd.grad(got_out, (q, k, v), grad_out))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk", [16, 50, 99, 100, 1000])
def test_causal_chunks_equal_one_call(chunk):
    """Chunks of 16 (exact), 50 (a short last chunk), 99, and 100 / 1000 (one call): output and dq, dk, dv equal
    one SDPA call under the whole mask."""
    _grads_equal_one_call(_selection_like_mask(2, 100), 100, causal_chunk=chunk)


@pytest.mark.parametrize("rows,chunk", [(37, 0), (37, 16), (37, 1000), (64, 16), (99, 50), (100, 0), (150, 16)])
def test_plain_causal_rows_equal_one_call(rows, chunk):
    """The first `rows` rows through the causal kernel without the mask (all of them, with no mask given, at 100 and
    150), the rest in chunks or in one call: output and dq, dk, dv equal one SDPA call under the whole mask."""
    _grads_equal_one_call(_selection_like_mask(2, 100, causal_rows=min(rows, 100)), 100, causal_chunk=chunk,
                          causal_rows=rows)


def test_plain_causal_rows_differ_from_a_mask_that_is_not_causal_there():
    """The causal kernel really replaces the mask on those rows: given a mask that drops keys there, the rows
    differ from the masked call (the caller's guarantee is what makes them equal)."""
    q = k = v = torch.randn(1, 2, 20, 4, generator=torch.Generator().manual_seed(2))
    mask = _selection_like_mask(1, 20)  # two documents, half of each past: not causal in its first rows
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
    got = masked_attention(q, k, v, mask, scale=4**-0.5, causal_rows=12)
    assert not torch.allclose(got[:, :, :12], want[:, :, :12])
    torch.testing.assert_close(got[:, :, 12:], want[:, :, 12:])


def test_chunks_compute_only_keys_up_to_their_last_query(sdpa_calls):
    """Each SDPA call gets the keys up to its chunk's last query, and the counts match masked_keys_per_query."""
    calls = sdpa_calls
    q = k = v = torch.randn(1, 1, 10, 4)
    masked_attention(q, k, v, _selection_like_mask(1, 10), scale=1.0, causal_chunk=4)
    assert calls == [(4, 4, False), (4, 8, False), (2, 10, False)]
    assert masked_keys_per_query(10, 4) == ((4 * 4 + 4 * 8 + 2 * 10) / 10, 0.0)
    assert masked_keys_per_query(10, 0) == masked_keys_per_query(10, 10) == (10, 0.0)
    assert masked_keys_per_query(4096, 1024) == (4096 * 5 / 8, 0.0)
    # 3 plain causal rows, then chunks of 4 from row 3
    calls.clear()
    masked_attention(q, k, v, _selection_like_mask(1, 10, causal_rows=3), scale=1.0, causal_chunk=4, causal_rows=3)
    assert calls == [(3, 3, True), (4, 7, False), (3, 10, False)]
    assert masked_keys_per_query(10, 4, 3) == ((4 * 7 + 3 * 10) / 10, 3 * 4 / 2 / 10)
    assert masked_keys_per_query(10, 0, 3) == (7.0, 0.6)
    calls.clear()
    masked_attention(q, k, v, None, scale=1.0, causal_chunk=4, causal_rows=10)
    assert calls == [(10, 10, True)]
    assert masked_keys_per_query(10, 4, 10) == (0.0, 5.5)


def test_chunks_need_a_square_mask_and_a_valid_key():
    q, k, v = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 12, 4), torch.randn(1, 1, 12, 4)
    with pytest.raises(ValueError, match="causal_chunk / causal_rows need as many queries as keys"):
        masked_attention(q, k, v, torch.ones(1, 8, 12, dtype=torch.bool), scale=1.0, causal_chunk=4)
    with pytest.raises(ValueError, match="causal_chunk / causal_rows need as many queries as keys"):
        masked_attention(q, k, v, torch.ones(1, 8, 12, dtype=torch.bool), scale=1.0, causal_rows=4)
    with pytest.raises(ValueError, match="a mask is needed unless every row is causal"):
        masked_attention(k, k, v, None, scale=1.0, causal_rows=4)
    with pytest.raises(ModelArgsError, match="dsa_mask_query_chunk"):
        get_flavor("debug").replace(dsa_mask_query_chunk=-1)
