"""ops/indexer_topk.py and ops/indexer_kl.py: tiled selection and KL against untiled computations."""

from __future__ import annotations

import pytest
import torch

from torchtitan_glm.models.glm5.dsa import DocLayout, pool_layout
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops.indexer_kl import indexer_kl_dense, indexer_kl_sparse
from torchtitan_glm.ops.indexer_topk import kpool_topk


class Layout:
    """Documents, pools and the op arguments derived from them (as dsa.py derives them)."""

    def __init__(self, doc_ids: torch.Tensor, kpool: int):
        bsz, seqlen = doc_ids.shape
        self.doc = DocLayout(*doc_positions(doc_ids, bsz, seqlen, torch.device("cpu")))
        self.pools = pool_layout(self.doc, kpool)
        self.kpool, self.seqlen = kpool, seqlen
        self.last = torch.where(self.pools.used, self.pools.start + kpool - 1, seqlen)
        t = torch.arange(seqlen)
        same_doc = self.pools.key[:, None, :] == self.doc.key[:, :, None]
        self.valid = (self.last[:, None, :] <= t[None, :, None]) & same_doc


def _doc_ids(seqlen: int) -> torch.Tensor:
    t = torch.arange(seqlen)
    row0 = (t >= 13).long() + (t >= 30).long() + (t >= seqlen - 5).long()  # short docs, one shorter than kpool
    return torch.stack([row0, torch.zeros_like(t)])


def untiled_scores(q, w, pk):
    """The pre-tiling indexer score over [B, T, H, P] at once."""
    s = torch.matmul(q, pk.transpose(-1, -2).unsqueeze(1))
    s = torch.relu(s * q.shape[-1] ** -0.5)
    return torch.matmul(w.unsqueeze(-2), s).squeeze(-2)


def untiled_select(scores, valid, k):
    masked = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
    top = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.where(valid.gather(-1, top), top, -1)


def exact_inputs(bsz, seqlen, heads, dim, slots, seed):
    """Small integers (w halves): every score is exact in FP32 whatever the summation order, and many tie."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (bsz, seqlen, heads, dim), generator=gen).float()
    pk = torch.randint(-2, 3, (bsz, slots, dim), generator=gen).float()
    w = torch.randint(-2, 3, (bsz, seqlen, heads), generator=gen).float() * 0.5
    return q, w, pk


@pytest.mark.parametrize("kpool,k", [(4, 3), (2, 5), (1, 6), (4, 40)])
def test_tiled_topk_equals_untiled_stable_sort(kpool, k):
    seqlen = 48
    lay = Layout(_doc_ids(seqlen), kpool)
    slots = lay.pools.start.shape[1]
    q, w, pk = exact_inputs(2, seqlen, 3, 4, slots, seed=kpool + k)
    scores = untiled_scores(q, w, pk)
    # Ties really occur among the candidates (the stable order matters).
    assert any(len(set(scores[b, t][lay.valid[b, t]].tolist())) < int(lay.valid[b, t].sum())
               for b in range(2) for t in range(seqlen))
    want = untiled_select(scores, lay.valid, k)
    for tile in (1, 5, 16, seqlen):
        got = kpool_topk(q, w, pk, lay.last, lay.pools.key, lay.doc.key, k, kpool, tile)
        assert got.shape == (2, seqlen, k)
        assert torch.equal(got[..., : want.shape[-1]], want), f"tile {tile}"
        assert (got[..., want.shape[-1]:] == -1).all()


def test_topk_handles_negative_zero_and_negative_scores():
    q = torch.ones(2, 3, 1, 1)  # [B, T, H=1, d=1]; pools 0, 1, 2 end at tokens 0, 1, 2 (kpool 1)
    w = torch.tensor([-1.0, 1.0]).view(2, 1, 1).expand(2, 3, 1)
    pk = torch.tensor([-1.0, 2.0, 0.0]).view(1, 3, 1).expand(2, 3, 1)  # query 2 of row 0: (-0.0, -2, -0.0)
    last = torch.arange(3).expand(2, 3)
    key = torch.zeros(2, 3, dtype=torch.long)
    got = kpool_topk(q, w, pk, last, key, key, 3, 1, 2)
    assert got[:, 2].tolist() == [[0, 2, 1], [1, 0, 2]]
    assert got[:, 0].tolist() == [[0, -1, -1], [0, -1, -1]]


def untiled_dense_kl(q, w, pk, lay: Layout, attn_q, attn_kv, scale):
    """Pre-tiling dense target ([B, H, T, T] attention summed per pool) and KL, differentiable in (q, w, pk)."""
    scores = untiled_scores(q, w, pk)
    t = torch.arange(lay.seqlen)
    allowed = (t[None, :, None] >= t[None, None, :]) & (lay.doc.key[:, :, None] == lay.doc.key[:, None, :])
    logits = torch.einsum("bthr,bsr->bhts", attn_q, attn_kv) * scale
    probs = logits.masked_fill(~allowed[:, None], float("-inf")).softmax(-1).sum(1)  # [B, T, T]
    slots = lay.pools.start.shape[1]
    dump = lay.pools.token_slot.masked_fill(lay.pools.token_slot < 0, slots)
    per_pool = torch.zeros(*probs.shape[:2], slots + 1).scatter_add(-1, dump[:, None].expand_as(probs), probs)
    return _kl(scores, lay.valid, per_pool[..., :slots] * lay.valid)


def _kl(scores, support, mass):
    target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-20)
    logq = torch.log_softmax(scores.masked_fill(~support, float("-inf")), -1)
    terms = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-30)) - logq), torch.zeros_like(target))
    rows = support.any(-1)
    return terms.sum(-1)[rows].sum(), rows.sum().float()


def _inputs(bsz, seqlen, slots, seed, heads_i=3, dim_i=8, heads=4, rank=6):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, seqlen, heads_i, dim_i, generator=gen)
    w = torch.randn(bsz, seqlen, heads_i, generator=gen)
    pk = torch.randn(bsz, slots, dim_i, generator=gen)
    attn_q = torch.randn(bsz, seqlen, heads, rank, generator=gen)
    attn_kv = torch.randn(bsz, seqlen, rank, generator=gen)
    return q, w, pk, attn_q, attn_kv


def _grads(fn, *leaves):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    kl, rows = fn(*leaves)
    kl.backward()
    return kl.detach(), rows, [x.grad for x in leaves]


@pytest.mark.parametrize("kpool", [4, 2])
def test_dense_kl_tiled_equals_untiled(kpool):
    seqlen = 41
    lay = Layout(_doc_ids(seqlen), kpool)
    q, w, pk, aq, akv = _inputs(2, seqlen, lay.pools.start.shape[1], seed=kpool)
    want_kl, want_rows, want_grads = _grads(lambda a, b, c: untiled_dense_kl(a, b, c, lay, aq, akv, 0.4), q, w, pk)
    assert want_rows > 0 and all(g.abs().max() > 0 for g in want_grads)
    for tile in (1, 6, seqlen):
        def op(a, b, c):
            kl, rows, *_ = indexer_kl_dense(a, b, c, lay.pools.start, lay.last, lay.pools.key, lay.doc.key, aq, akv,
                                            0.4, kpool, tile, True)
            return kl, rows
        kl, rows, grads = _grads(op, q, w, pk)
        torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-6)
        assert rows == want_rows
        for name, g, want in zip("q w pk".split(), grads, want_grads):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6, msg=f"tile {tile}: d{name}")


def direct_sparse_kl(q, w, pk, pool_ids, attn_q, attn_kv, indices, scale, kpool):
    """Per query: the sparse attention's softmax over its K indices, summed over heads and per selected pool."""
    total, rows = q.new_zeros(()), 0
    bsz, seqlen = pool_ids.shape[:2]
    for b in range(bsz):
        for t in range(seqlen):
            sel = [int(p) for p in pool_ids[b, t] if p >= 0]
            if not sel:
                continue
            idx = [int(i) for i in indices[b, t] if i >= 0]
            att = (torch.einsum("hr,kr->hk", attn_q[b, t], attn_kv[b, idx]) * scale).softmax(-1).sum(0)
            mass = torch.stack([sum(att[idx.index(int(s))] for s in indices[b, t, j * kpool:(j + 1) * kpool])
                                for j in range(len(sel))])
            target = mass / mass.sum()
            s = torch.relu(torch.einsum("hd,pd->hp", q[b, t], pk[b, sel]) * q.shape[-1] ** -0.5)
            logq = torch.log_softmax((w[b, t, :, None] * s).sum(0), -1)
            total = total + (target * (target.log() - logq)).sum()
            rows += 1
    return total, torch.tensor(float(rows))


def _selection(lay: Layout, scores, k):
    """Pools from the untiled selection, expanded to tokens, then the tail (as dsa.py builds the indices)."""
    pool_ids = untiled_select(scores, lay.valid, k)
    start = lay.pools.start.gather(1, pool_ids.clamp(min=0).flatten(1)).view_as(pool_ids)
    tokens = torch.where((pool_ids >= 0)[..., None], start[..., None] + torch.arange(lay.kpool), -1).flatten(2)
    t = torch.arange(lay.seqlen)
    tail_len = (lay.doc.pos + 1) % lay.kpool
    j = torch.arange(lay.kpool - 1)
    tail = torch.where(j < tail_len[..., None], t[None, :, None] - j, -1)
    return pool_ids, torch.cat([tokens, tail], -1).int()


@pytest.mark.parametrize("tile", [1, 7, 200])
def test_sparse_kl_matches_direct_computation(tile):
    seqlen, kpool, k = 37, 4, 3
    lay = Layout(_doc_ids(seqlen), kpool)
    q, w, pk, aq, akv = _inputs(2, seqlen, lay.pools.start.shape[1], seed=11)
    pool_ids, indices = _selection(lay, untiled_scores(q, w, pk), k)
    assert (pool_ids == -1).any() and (pool_ids >= 0).any()
    want_kl, want_rows, want_grads = _grads(
        lambda a, b, c: direct_sparse_kl(a, b, c, pool_ids, aq, akv, indices, 0.4, kpool), q, w, pk)

    def op(a, b, c):
        kl, rows, *_ = indexer_kl_sparse(a, b, c, pool_ids, aq, akv, indices, 0.4, kpool, tile, True)
        return kl, rows
    kl, rows, grads = _grads(op, q, w, pk)
    torch.testing.assert_close(kl, want_kl, rtol=1e-5, atol=1e-6)
    assert rows == want_rows
    for name, g, want in zip("q w pk".split(), grads, want_grads):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6, msg=f"d{name}")


def test_custom_op_contracts():
    seqlen, kpool, k = 20, 4, 2
    lay = Layout(_doc_ids(seqlen), kpool)
    q, w, pk, aq, akv = _inputs(2, seqlen, lay.pools.start.shape[1], seed=5)
    pool_ids, indices = _selection(lay, untiled_scores(q, w, pk), k)
    q, w, pk = (x.requires_grad_() for x in (q, w, pk))
    torch.library.opcheck(torch.ops.torchtitan_glm.kpool_topk.default,
                          (q.detach(), w.detach(), pk.detach(), lay.last, lay.pools.key, lay.doc.key, k, kpool, 3))
    torch.library.opcheck(torch.ops.torchtitan_glm.indexer_kl_sparse.default,
                          (q, w, pk, pool_ids, aq, akv, indices, 0.4, kpool, 3, True))
    torch.library.opcheck(torch.ops.torchtitan_glm.indexer_kl_dense.default,
                          (q, w, pk, lay.pools.start, lay.last, lay.pools.key, lay.doc.key, aq, akv, 0.4, kpool, 3,
                           True))


def test_exact_tf32_sets_and_restores_the_matmul_precision():
    from torchtitan_glm.ops.indexer_kl import _bf16_on_cuda, exact_tf32

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    with exact_tf32(False):
        assert matmul.fp32_precision == before
    with pytest.raises(RuntimeError, match="inside"):
        with exact_tf32(True):
            assert matmul.fp32_precision == "tf32"
            raise RuntimeError("inside")
    assert matmul.fp32_precision == before
    # the training path's BF16 attention inputs on CUDA only; FP32 inputs (the parity tests) keep IEEE FP32
    assert not _bf16_on_cuda(torch.zeros(1, dtype=torch.bfloat16))
    assert not _bf16_on_cuda(torch.zeros(1, dtype=torch.float32))
