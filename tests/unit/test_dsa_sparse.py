"""The DSA block on its sparse path: no T x T tensor, a 'shared' layer attends exactly the previous selection, the
indexer learns only from its KL, selective checkpointing keeps the indexer's tiled ops out of the recompute."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchtitan_glm.activation_checkpoint import wrap_block
from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.models.glm5.decoder import DecoderLayer
from torchtitan_glm.models.glm5.batch import BatchLayout
from torchtitan_glm.models.glm5.dsa import DocLayout, SparseMLA
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops import sparse_mla as sparse_mla_module

_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


class LargestTensor(TorchDispatchMode):
    """Records the largest numel any op produces, inside this project's custom ops too (their CPU kernels are run
    under the mode), and counts the custom-op calls."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.where = 0, ""
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "torchtitan_glm":
            self.calls[func.__name__.split(".")[0]] += 1
            with self:
                out = func.redispatch(_CPU, *args, **kwargs)
        else:
            out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.where = t.numel(), str(func)
        return out


def _doc(seqlen: int, bsz: int = 1) -> DocLayout:
    t = torch.arange(seqlen)
    doc_ids = ((t >= seqlen // 3).long() + (t >= 2 * seqlen // 3 + 5).long()).expand(bsz, seqlen)
    return DocLayout(*doc_positions(doc_ids, bsz, seqlen, torch.device("cpu")))


def _batch(doc: DocLayout, kl: str | None = None) -> BatchLayout:
    return BatchLayout(doc, doc.key, None, kl, False)  # doc.key: per-token document ids


def _assert_same_run(got: tuple, want: tuple, kl: str | None) -> None:
    """(output, indices, KL sum, gradients) of two runs: the same selection, the same values (fp32)."""
    (out1, idx1, kl1, g1), (out0, idx0, kl0, g0) = got[:4], want[:4]
    assert torch.equal(idx0, idx1)
    torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-6)
    if kl is not None:
        torch.testing.assert_close(kl1, kl0, rtol=1e-5, atol=1e-7)
    for a, b in zip(g1, g0):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _attn(seed: int = 0, **overrides) -> SparseMLA:
    torch.manual_seed(seed)
    attn = SparseMLA(get_flavor("debug").replace(**overrides))
    attn.init_weights()
    return attn


@pytest.mark.parametrize("kl", ["sparse", "dense"])
def test_no_quadratic_tensor_at_moderate_length(monkeypatch, kl):
    seqlen = 2048
    monkeypatch.setattr(sparse_mla_module, "_TILE_ELEMENTS", 1 << 16)
    attn = _attn(indexer_tile_elements=1 << 16)
    x = torch.randn(1, seqlen, 64, requires_grad=True)
    with LargestTensor() as rec:
        out, indices, stats = attn(x, _batch(_doc(seqlen), kl))
        (out.square().mean() + stats.kl_sum / stats.rows).backward()
    assert {"sparse_mla_fwd", "sparse_mla_bwd", "kpool_topk", f"indexer_kl_{kl}"} <= set(rec.calls)
    assert stats.rows > 0.9 * seqlen and x.grad.abs().max() > 0
    # T * T / 16 = 262,144 elements; the inputs themselves are T x 64 = 131,072.
    assert rec.largest <= seqlen * seqlen // 16, f"{rec.largest} elements from {rec.where}"

    # The recorder does see a quadratic tensor where there is one: the dense warm-up's [B, T, T] mask.
    dense = _attn(dsa_attention="dense")
    with LargestTensor() as rec:
        dense(x.detach(), _batch(_doc(seqlen), "dense"))
    assert rec.largest >= seqlen * seqlen


def test_shared_layer_attends_exactly_the_previous_selection():
    seqlen = 96
    doc = _doc(seqlen, bsz=2)
    full, shared = _attn(seed=1), _attn(seed=2)
    shared.indexer = None
    x = torch.randn(2, seqlen, 64)
    with torch.no_grad():
        _, indices, _ = full(x, _batch(doc))
        got, passed_on, _ = shared(x, _batch(doc), indices)
        # Expanded MLA (kv_b_proj called as a Linear) under the dense mask the indices describe.
        mask = torch.zeros(2, seqlen, seqlen + 1, dtype=torch.bool)
        mask.scatter_(-1, torch.where(indices >= 0, indices.long(), seqlen), True)
        mask = mask[..., :seqlen]
        assert not mask.all(-1).any() and (mask.sum(-1) <= indices.shape[-1]).all()
        q = shared.q_b_proj(shared.q_a_layernorm(shared.q_a_proj(x))).unflatten(-1, (4, 16)).transpose(1, 2)
        kv = shared.kv_b_proj(shared.kv_a_layernorm(shared.kv_a_proj_with_mqa(x)))
        k, v = kv.unflatten(-1, (4, 32)).transpose(1, 2).split([16, 16], -1)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=shared.scale)
        want = shared.o_proj(want.transpose(1, 2).flatten(-2))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert passed_on is indices
    with pytest.raises(ValueError, match="shared"):
        shared(x, _batch(doc))


def test_indexer_learns_only_from_its_kl():
    attn = _attn()
    x = torch.randn(1, 64, 64, requires_grad=True)
    out, _, stats = attn(x, _batch(_doc(64), "sparse"))
    indexer = {n for n, _ in attn.named_parameters() if n.startswith("indexer.")}
    lm = dict(zip(attn.state_dict(), torch.autograd.grad(out.sum(), list(attn.parameters()), allow_unused=True)))
    kl = dict(zip(attn.state_dict(), torch.autograd.grad(stats.kl_sum, list(attn.parameters()), allow_unused=True)))
    assert all(lm[n] is None for n in indexer) and all(lm[n] is not None for n in lm if n not in indexer)
    assert all(kl[n] is not None and kl[n].abs().max() > 0 for n in indexer), [n for n in indexer if kl[n] is None]
    assert all(kl[n] is None for n in kl if n not in indexer)
    assert not stats.rows.requires_grad


def test_kl_mode_must_match_the_attention():
    with pytest.raises(ValueError, match="sparse indexer KL"):
        _attn(dsa_attention="dense")(torch.randn(1, 8, 64), _batch(_doc(8), "sparse"))
    with pytest.raises(ValueError, match="indexer_kl"):
        _attn()(torch.randn(1, 8, 64), _batch(_doc(8), "yes"))


@pytest.mark.parametrize("mode,runs", [("selective", 1), ("full", 2)])
def test_selective_checkpoint_keeps_indexer_ops(mode, runs):
    args = get_flavor("debug")
    torch.manual_seed(0)
    layer = DecoderLayer(args, 3)
    layer.init_weights()
    block = wrap_block(layer, mode=mode)
    streams = torch.randn(1, 48, args.hc_mult, args.hidden_size, requires_grad=True)
    doc = _doc(48)
    with LargestTensor() as rec:
        out, _, stats, _ = block(streams, _batch(doc, "sparse"))
        (out.square().mean() + stats.kl_sum / stats.rows).backward()
    for op in ("sparse_mla_fwd", "kpool_topk", "indexer_kl_sparse"):
        assert rec.calls[op] == runs, (op, dict(rec.calls))
    assert rec.calls["sparse_mla_bwd"] == 1


@pytest.mark.parametrize("kl,chunk", [(None, 0), ("sparse", 0), ("dense", 0), (None, 40), ("sparse", 40)])
def test_dense_kernel_at_short_rows_is_the_sparse_function(kl, chunk):
    """Rows of at most dsa_dense_max_len tokens attend the selection through masked SDPA (a [T, T] mask made from
    the indices), in one call or in query chunks (dsa_mask_query_chunk; 96 rows = 40 + 40 + 16): the same output,
    selection, KL and gradients as the sparse kernel (fp32), and only there."""
    seqlen = 96
    doc = _doc(seqlen, bsz=2)
    x = torch.randn(2, seqlen, 64, dtype=torch.float64).float()
    results = {}
    for max_len in (0, seqlen):
        attn = _attn(seed=3, dsa_dense_max_len=max_len, dsa_mask_query_chunk=chunk)
        xi = x.clone().requires_grad_()
        with LargestTensor() as rec:
            out, indices, stats = attn(xi, _batch(doc, kl))
            loss = out.square().mean() + (stats.kl_sum / stats.rows if stats is not None else 0)
            grads = torch.autograd.grad(loss, [xi, *attn.parameters()], allow_unused=True)
        assert ("sparse_mla_fwd" in rec.calls) == (max_len == 0), rec.calls
        results[max_len] = (out, indices, None if stats is None else stats.kl_sum, grads)
    _assert_same_run(results[seqlen], results[0], kl)
    # one token longer than the bound: the sparse kernel again
    attn = _attn(seed=3, dsa_dense_max_len=seqlen - 1)
    with LargestTensor() as rec:
        attn(x, _batch(doc, kl))
    assert "sparse_mla_fwd" in rec.calls


def test_selection_mask_marks_exactly_the_indices():
    from torchtitan_glm.models.glm5.dsa import selection_mask

    indices = torch.tensor([[[0, -1, -1], [1, 0, -1], [2, 0, 1]]], dtype=torch.int32)
    want = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 1, 1]]], dtype=torch.bool)
    assert torch.equal(selection_mask(indices, 3), want)
    assert selection_mask(indices, 3).dtype == torch.bool


@pytest.mark.parametrize("kl,chunk", [(None, 0), (None, 40), ("sparse", 40)])
def test_one_document_rows_run_their_full_selection_rows_causal(kl, chunk, sdpa_calls):
    """One document per row (no doc_ids): the queries whose selection still holds every past token, the first
    index_topk + kpool - 1 = 19 of the debug flavor, run SDPA's causal kernel with no mask; the
    output, selection, KL and gradients equal the sparse kernel's (fp32). The premise is checked too: those rows'
    selection is the whole causal past, the next row's is not."""
    seqlen = 96
    doc = DocLayout(*doc_positions(None, 2, seqlen, torch.device("cpu")))
    x = torch.randn(2, seqlen, 64, dtype=torch.float64).float()
    calls = sdpa_calls
    results = {}
    for max_len, causal_rows in ((0, True), (seqlen, True), (seqlen, False)):
        attn = _attn(seed=3, dsa_dense_max_len=max_len, dsa_mask_query_chunk=chunk, dsa_mask_causal_rows=causal_rows)
        xi = x.clone().requires_grad_()
        calls.clear()
        out, indices, stats = attn(xi, BatchLayout(doc, None, None, kl, False))
        loss = out.square().mean() + (stats.kl_sum / stats.rows if stats is not None else 0)
        grads = torch.autograd.grad(loss, [xi, *attn.parameters()], allow_unused=True)
        results[max_len, causal_rows] = (out, indices, None if stats is None else stats.kl_sum, grads, list(calls))
    assert _attn(seed=3).causal_rows(seqlen) == 19 and attn.causal_rows(seqlen) == 0  # the last: the flag off
    plain = [c for c in results[seqlen, True][4] if c[2]]
    assert plain == [(19, 19, True)], results[seqlen, True][4]
    assert not any(c[2] for c in results[seqlen, False][4])
    from torchtitan_glm.models.glm5.dsa import selection_mask

    sel = selection_mask(results[0, True][1], seqlen)
    assert torch.equal(sel[:, :19], torch.ones(19, seqlen, dtype=torch.bool).tril().expand(2, -1, -1))
    assert not sel[:, 19, :20].all(dim=-1).any()  # row 19: 5 complete pools, 4 selected
    _assert_same_run(results[seqlen, True], results[0, True], kl)
    _assert_same_run(results[seqlen, False], results[0, True], kl)


def test_one_document_dense_stage_is_plain_causal(sdpa_calls):
    """The dense stage of a one-document row is plain causal attention: one SDPA call with no mask, the same output
    and gradients as under the [T, T] causal mask (dsa_mask_causal_rows off). Rows with documents keep the mask."""
    seqlen = 40
    x = torch.randn(1, seqlen, 64, dtype=torch.float64).float()
    calls = sdpa_calls
    one_doc = DocLayout(*doc_positions(None, 1, seqlen, torch.device("cpu")))
    results = []
    for causal_rows in (True, False):
        attn = _attn(seed=5, dsa_attention="dense", dsa_mask_causal_rows=causal_rows)
        xi = x.clone().requires_grad_()
        calls.clear()
        out, _, _ = attn(xi, BatchLayout(one_doc, None))
        params = [p for p in attn.parameters() if p.requires_grad]
        grads = torch.autograd.grad(out.square().mean(), [xi, *params], allow_unused=True)
        results.append((out, [g for g in grads if g is not None], list(calls)))
    assert results[0][2] == [(seqlen, seqlen, True)] and results[1][2] == [(seqlen, seqlen, False)]
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    assert len(results[0][1]) == len(results[1][1]) > 5
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    calls.clear()
    _attn(seed=5, dsa_attention="dense")(x, _batch(_doc(seqlen)))
    assert calls == [(seqlen, seqlen, False)]


@pytest.mark.parametrize("overrides,rows", [(dict(index_kpool_always_select_tail=False), 0),
                                            (dict(index_kpool=1, index_topk=8), 8)])
def test_causal_rows_without_the_tail_and_with_single_token_pools(overrides, rows):
    """Without the always-selected tail a query misses its own incomplete pool, so no row is plain causal; with
    one-token pools the first index_topk rows are. Either way the masked path equals the sparse kernel (fp32)."""
    seqlen = 48
    doc = DocLayout(*doc_positions(None, 1, seqlen, torch.device("cpu")))
    x = torch.randn(1, seqlen, 64, dtype=torch.float64).float()
    outs = []
    for max_len in (0, seqlen):
        attn = _attn(seed=4, dsa_dense_max_len=max_len, **overrides)
        outs.append(attn(x, BatchLayout(doc, None))[0])
    assert attn.causal_rows(seqlen) == rows
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
