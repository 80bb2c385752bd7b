"""Chunked CE == full-logits CE, indexer KL == a direct computation, router bias moves toward balance."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_glm.components.loss import indexer_kl_loss, update_router_bias
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.models.glm5.dsa import DocLayout, IndexerStats, pool_last, pool_layout
from torchtitan_glm.models.glm5.model import mtp_targets
from torchtitan_glm.models.glm5.moe import MoE
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops.indexer_kl import indexer_kl_dense, indexer_kl_sparse
from torchtitan_glm.ops.linear_cross_entropy import linear_cross_entropy


@pytest.mark.parametrize("chunk_size", [8, 37, 64])  # several chunks, exactly one, one larger than the tokens
def test_chunked_ce_equals_full_logits_ce(chunk_size):
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    y[[3, 10, 36]] = -100
    tw = torch.rand(37)
    loss, per_token = linear_cross_entropy(h, w, y, tw, chunk_size=chunk_size)
    (loss * 0.7).backward()  # an upstream gradient other than 1 reaches dX and dW
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref_tok = F.cross_entropy(h2 @ w2.t(), y, reduction="none", ignore_index=-100)
    ref = (ref_tok * tw).sum()
    (ref * 0.7).backward()
    torch.testing.assert_close(per_token, ref_tok.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)


class _MatmulDtypes(TorchDispatchMode):
    """Records the operand dtypes of every matrix product run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


def test_chunked_ce_bf16_runs_bf16_gemms_and_matches_fp32():
    """BF16 weights: every GEMM (logits, dX, dW) takes BF16 operands (an FP32 dW GEMM is a 10x slower SIMT kernel
    on the GPU); loss and gradients stay within BF16 rounding of the FP32 computation on the same values."""
    torch.manual_seed(0)
    h = torch.randn(40, 32).bfloat16().requires_grad_()
    w = (torch.randn(96, 32) * 0.2).bfloat16().requires_grad_()
    y = torch.randint(0, 96, (40,))
    y[[0, 17]] = -100
    tw = torch.full((40,), 1.0 / 38)
    with _MatmulDtypes() as mm:
        loss, _ = linear_cross_entropy(h, w, y, tw, chunk_size=16)
        loss.backward()
    assert len(mm.seen) == 3 * 3  # logits, dX, dW for each of the 3 chunks
    assert all(d == torch.bfloat16 for dtypes in mm.seen for d in dtypes), mm.seen
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = (F.cross_entropy(h32 @ w32.t(), y, reduction="none", ignore_index=-100) * tw).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-2, atol=0)
    for got, want in ((h.grad, h32.grad), (w.grad, w32.grad)):
        err = (got.float() - want).norm() / want.norm()
        assert err < 1e-2, err


class _Fp32WeightShaped(TorchDispatchMode):
    """Counts the FP32 tensors of a given shape that ops create."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.count = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == self.shape:
                self.count += 1
        return out


@pytest.mark.parametrize("chunk_size,several", [(40, False), (4096, False), (16, True)])
def test_chunked_ce_bf16_one_chunk_has_no_fp32_weight_gradient(chunk_size, several):
    """BF16 head: one chunk writes dW in BF16, so no FP32 [vocab, D] tensor exists in forward or backward; several
    chunks do sum in FP32 (the control that the count sees such tensors)."""
    torch.manual_seed(0)
    h = torch.randn(40, 32).bfloat16().requires_grad_()
    w = (torch.randn(96, 32) * 0.2).bfloat16().requires_grad_()
    y = torch.randint(0, 96, (40,))
    tw = torch.full((40,), 1.0 / 40)
    with _Fp32WeightShaped(w.shape) as seen:
        loss, _ = linear_cross_entropy(h, w, y, tw, chunk_size=chunk_size)
        loss.backward()
    assert (seen.count > 0) == several, seen.count
    assert w.grad.dtype == torch.bfloat16 and h.grad.dtype == torch.bfloat16
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (F.cross_entropy(h32 @ w32.t(), y, reduction="none") * tw).sum().backward()
    for got, want in ((h.grad, h32.grad), (w.grad, w32.grad)):
        assert (got.float() - want).norm() / want.norm() < 1e-2


def test_model_training_loss_equals_logits_loss():
    torch.manual_seed(0)
    model = Glm5Model(get_flavor("debug"))
    tokens = torch.randint(0, 512, (2, 24))
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    labels[0, 5] = -100  # a document end
    out = model(tokens, labels=labels, token_scale=0.25, mtp_scale=0.1 * 0.25)
    hs = model.hidden_states(tokens)
    ce = F.cross_entropy(model.lm_head(hs.hidden).flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    mtp = F.cross_entropy(model.lm_head(hs.mtp_hidden).flatten(0, 1), mtp_targets(labels).flatten(), reduction="sum",
                          ignore_index=-100)
    torch.testing.assert_close(out.loss, 0.25 * ce + 0.025 * mtp, rtol=1e-5, atol=1e-6)
    assert (mtp_targets(labels)[0, 4] == -100 and mtp_targets(labels)[0, 5] == -100
            and mtp_targets(labels)[0, 3] == labels[0, 4])


def test_dense_indexer_kl_matches_direct_computation():
    torch.manual_seed(0)
    b, h, t, r, ih, idim, kpool = 1, 3, 19, 8, 2, 4, 4
    doc_ids = torch.tensor([[0] * 11 + [1] * 6 + [2] * 2])  # 3 complete pools in 4 slots
    doc = DocLayout(*doc_positions(doc_ids, b, t, torch.device("cpu")))
    pools = pool_layout(doc, kpool)
    slots = pools.start.shape[1]
    attn_q, attn_kv = torch.randn(b, t, h, r), torch.randn(b, t, r)
    q, w = torch.randn(b, t, ih, idim, requires_grad=True), torch.randn(b, t, ih, requires_grad=True)
    pk = torch.randn(b, slots, idim, requires_grad=True)
    kl, rows, *_ = indexer_kl_dense(q, w, pk, pools.start, pool_last(pools, kpool, doc), pools.key, doc.key, attn_q,
                                    attn_kv, 0.5, kpool, 5, True)
    loss = indexer_kl_loss([IndexerStats(kl, rows)])

    # Direct: loop over queries; attention over same-document past tokens; mass per complete visible pool.
    kls, seen = [], set()
    for i in range(t):
        keys = [j for j in range(i + 1) if doc_ids[0, j] == doc_ids[0, i]]
        att = torch.softmax(torch.stack([attn_q[0, i] @ attn_kv[0, j] * 0.5 for j in keys], -1), -1).sum(0)
        mass = {}
        for p in range(slots):
            s0 = int(pools.start[0, p])
            if pools.used[0, p] and s0 + kpool - 1 <= i and doc_ids[0, s0] == doc_ids[0, i]:
                mass[p] = sum(float(att[keys.index(j)]) for j in range(s0, s0 + kpool))
        if not mass:
            continue
        seen.update(mass)
        z = sum(mass.values())
        ps = list(mass)
        scores = torch.stack([(w[0, i] * torch.relu(q[0, i] @ pk[0, p] * idim**-0.5)).sum() for p in ps])
        logq = torch.log_softmax(scores, -1)
        kls.append(sum((mass[p] / z) * (math.log(mass[p] / z) - logq[n]) for n, p in enumerate(ps)))
    assert int(rows) == len(kls) < t  # queries before the first complete pool of their document do not count
    want = torch.stack(kls).mean()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(loss, (q, w, pk))
    for g, e in zip(grads, torch.autograd.grad(want, (q, w, pk))):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    unseen = [p for p in range(slots) if p not in seen]
    assert unseen and grads[2][0, unseen].abs().max() == 0 and grads[2].abs().max() > 0


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_indexer_kl_is_nan_when_attention_is_nan(mode):
    """NaN attention upstream (e.g. a diverged run) must show as a NaN KL, not as 0 (it used to log 0); so must NaN
    index scores."""
    torch.manual_seed(0)
    t, kpool = 12, 2
    doc = DocLayout(*doc_positions(None, 1, t, torch.device("cpu")))
    pools = pool_layout(doc, kpool)
    slots = pools.start.shape[1]
    q, w, pk = torch.randn(1, t, 2, 4), torch.randn(1, t, 2), torch.randn(1, slots, 4)
    attn_q, attn_kv = torch.randn(1, t, 3, 8), torch.randn(1, t, 8)
    last = pool_last(pools, kpool, doc)
    # Sparse form: every visible pool selected (3 at most), then the query's tail.
    pool_ids = torch.full((1, t, 3), -1)
    for i in range(t):
        vis = [p for p in range(slots) if int(last[0, p]) <= i][:3]
        pool_ids[0, i, : len(vis)] = torch.tensor(vis, dtype=torch.long)
    tokens = torch.where(pool_ids[..., None] >= 0, pools.start[0, pool_ids.clamp(min=0)][..., None]
                         + torch.arange(kpool), -1).flatten(2)
    tail = torch.where((torch.arange(t) % kpool == 0)[None, :, None], torch.arange(t)[None, :, None], -1)
    indices = torch.cat([tokens, tail], -1).int()

    def kl(q, w, pk, attn_q):
        if mode == "dense":
            out = indexer_kl_dense(q, w, pk, pools.start, last, pools.key, doc.key, attn_q, attn_kv, 0.5, kpool, 4,
                                   False)
        else:
            out = indexer_kl_sparse(q, w, pk, pool_ids, attn_q, attn_kv, indices, 0.5, kpool, 4, False)
        return indexer_kl_loss([IndexerStats(out[0], out[1])])

    finite = kl(q, w, pk, attn_q)
    assert torch.isfinite(finite) and finite > 0
    nan = float("nan")
    for args in ((q, w, pk, torch.full_like(attn_q, nan)), (torch.full_like(q, nan), w, pk, attn_q)):
        assert torch.isnan(kl(*args))


def test_router_bias_moves_toward_balance():
    torch.manual_seed(0)
    args = get_flavor("debug")
    moe = MoE(args)
    moe.init_weights()
    with torch.no_grad():
        moe.gate.weight[0] += 0.5  # expert 0 attracts most tokens
    x = torch.randn(256, args.hidden_size) + 0.5  # positive mean: the shifted expert wins
    first = None
    for _ in range(60):
        _, stats = moe(x)
        ratio = update_router_bias(moe, [stats.counts], rate=0.02)
        first = float(ratio[0]) if first is None else first
    assert moe.gate.e_score_correction_bias[0] < 0
    assert float(ratio[0]) < 0.6 * first


def test_sequence_aux_loss_matches_direct_formula():
    from torchtitan_glm.models.glm5.moe import sequence_aux_loss

    torch.manual_seed(0)
    bsz, seqlen, e, k = 2, 5, 4, 2
    scores = torch.rand(bsz * seqlen, e)
    idx = scores.topk(k, dim=-1).indices
    got = sequence_aux_loss(scores, idx, batch=bsz, top_k=k)
    per_row = []
    for b in range(bsz):
        rows = range(b * seqlen, (b + 1) * seqlen)
        f = [e / (k * seqlen) * sum(int(i in idx[r].tolist()) for r in rows) for i in range(e)]
        p = [sum(float(scores[r, i] / scores[r].sum()) for r in rows) / seqlen for i in range(e)]
        per_row.append(sum(fi * pi for fi, pi in zip(f, p)))
    assert abs(float(got) - sum(per_row) / bsz) < 1e-6
    moe = MoE(get_flavor("debug"))
    moe.init_weights()
    _, stats = moe(torch.randn(2, 7, 64), seq_aux=True)
    assert stats.aux_loss.requires_grad and float(stats.aux_loss.detach()) > 0


@pytest.mark.parametrize("chunk_size", [16, 40])  # several chunks (FP32 dW sum), one
def test_compiled_ce_writes_no_fp32_logits_and_equals_eager(chunk_size):
    """Under inductor the CE fuses the upcast into its reductions and its gradient pass: the generated code allocates
    no FP32 [chunk, vocab] buffer (the eager form's in-place FP32 logits; with them the compiled proxy step held
    ~6 GiB in the CE at its peak), and loss and gradients equal eager's to FP32 summation order."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    h = torch.randn(40, 32).bfloat16()
    w = (torch.randn(96, 32) * 0.2).bfloat16()
    y = torch.randint(0, 96, (40,))
    y[[0, 17]] = -100
    tw = torch.rand(40)

    def run(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, per_token = fn(hh, ww, y, tw)
        loss.backward()
        return loss.detach(), per_token, hh.grad, ww.grad

    def ce(hh, ww, yy, tt):
        return linear_cross_entropy(hh, ww, yy, tt, chunk_size=chunk_size)

    torch._dynamo.reset()
    compiled, codes = run_and_get_code(run, torch.compile(ce, backend="inductor", fullgraph=True))
    eager = run(ce)
    rows = {min(chunk_size, 40 - s) for s in range(0, 40, chunk_size)}
    fp32_logits = [m for m in re.findall(r"empty_strided\w*\(\((\d+), (\d+)\), [^)]*\), torch\.float32\)",
                   "\n".join(codes)) if (int(m[0]), int(m[1])) in {(r, 96) for r in rows}]
    assert not fp32_logits, fp32_logits
    assert any("empty_strided" in c for c in codes)  # the pattern reads inductor's buffer allocations
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)


def test_compiled_ce_reads_the_target_without_a_gather():
    """Under compile each chunk's target logit is a masked sum over the vocabulary, not a gather: inductor fuses a
    gather into the one kernel that fills the per-token losses of every chunk, whose int32 offsets into each chunk's
    logits overflow past 2^31 / vocab rows (an illegal memory access on the GPU:
    tests/gpu/test_linear_cross_entropy_cuda.py). The graph the compiler receives holds no gather, and the loss
    equals eager's."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    h, w = torch.randn(24, 16).bfloat16(), (torch.randn(50, 16) * 0.2).bfloat16()
    y, tw = torch.randint(0, 50, (24,)), torch.rand(24)
    y[3] = -100

    def ce(hh, ww):
        return linear_cross_entropy(hh, ww, y, tw, chunk_size=8)

    torch._dynamo.reset()
    got = torch.compile(ce, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(h.requires_grad_(), w)
    want = ce(h, w)
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert graphs and "aten.mm.default" in ops and not any("gather" in op for op in ops), sorted(ops)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-5, atol=1e-6)
