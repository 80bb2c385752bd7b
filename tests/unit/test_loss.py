"""Chunked CE == full-logits CE, indexer KL == a direct computation, router bias moves toward balance."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_glm.components.loss import indexer_kl_loss, update_router_bias
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.models.glm5.dsa import DocLayout, IndexerStats, pool_layout, pooled_attention_target
from torchtitan_glm.models.glm5.model import mtp_targets
from torchtitan_glm.models.glm5.moe import MoE
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops.linear_cross_entropy import linear_cross_entropy


def test_chunked_ce_equals_full_logits_ce():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    y = torch.randint(0, 50, (37,))
    y[[3, 10, 36]] = -100
    tw = torch.rand(37)
    loss, per_token = linear_cross_entropy(h, w, y, tw, chunk_size=8)
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref_tok = F.cross_entropy(h2 @ w2.t(), y, reduction="none", ignore_index=-100)
    ref = (ref_tok * tw).sum()
    ref.backward()
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
    assert mtp_targets(labels)[0, 4] == -100 and mtp_targets(labels)[0, 5] == -100 and mtp_targets(labels)[0, 3] == labels[0, 4]


def test_pooled_attention_target_and_kl_match_direct_computation():
    torch.manual_seed(0)
    b, h, t, d, kpool = 1, 3, 19, 8, 4
    doc_ids = torch.tensor([[0] * 11 + [1] * 8])
    doc = DocLayout(*doc_positions(doc_ids, b, t, torch.device("cpu")))
    pools = pool_layout(doc, kpool)
    q, k = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    ends = pools.start + kpool - 1
    valid = pools.used[:, None] & (ends[:, None] <= torch.arange(t)[None, :, None]) & (pools.key[:, None] == doc.key[:, :, None])
    target = pooled_attention_target(q, k, doc, pools, valid, scale=0.5, query_chunk=5)
    logits = torch.randn(b, t, pools.start.shape[1], requires_grad=True)
    selected = valid & (torch.rand(valid.shape) > 0.3)
    loss = indexer_kl_loss([IndexerStats(logits, target, valid, selected)], sparse=False)

    # Direct: loop over queries; attention over same-document past tokens; mass per complete pool.
    kls = []
    for i in range(t):
        keys = [j for j in range(i + 1) if doc_ids[0, j] == doc_ids[0, i]]
        att = torch.softmax(torch.stack([(q[0, :, i] * k[0, :, j]).sum(-1) * 0.5 for j in keys], -1), -1).sum(0)
        mass = {}
        for p in range(pools.start.shape[1]):
            if valid[0, i, p]:
                s0 = int(pools.start[0, p])
                mass[p] = sum(float(att[keys.index(j)]) for j in range(s0, s0 + kpool))
        if not mass:
            continue
        z = sum(mass.values())
        for p, m in mass.items():
            assert math.isclose(float(target[0, i, p]), m / z, rel_tol=1e-5, abs_tol=1e-7)
        ps = list(mass)
        logq = torch.log_softmax(logits[0, i, ps], -1)
        kls.append(sum((mass[p] / z) * (math.log(mass[p] / z) - logq[n]) for n, p in enumerate(ps)))
    torch.testing.assert_close(loss, torch.stack(kls).mean(), rtol=1e-5, atol=1e-6)
    loss.backward()
    assert logits.grad[~valid].abs().max() == 0 and logits.grad.abs().max() > 0


def test_indexer_kl_is_nan_when_attention_is_nan():
    """NaN attention upstream (e.g. a diverged run) must show as a NaN KL, not as 0 (it used to log 0)."""
    torch.manual_seed(0)
    b, t, p = 1, 6, 3
    valid = torch.ones(b, t, p, dtype=torch.bool)
    target = torch.softmax(torch.randn(b, t, p), -1)
    logits = torch.randn(b, t, p)
    finite = indexer_kl_loss([IndexerStats(logits, target, valid, valid)], sparse=False)
    assert torch.isfinite(finite) and finite > 0
    for bad_target, bad_logits in ((torch.full_like(target, float("nan")), logits),
                                   (target, torch.full_like(logits, float("nan")))):
        kl = indexer_kl_loss([IndexerStats(bad_logits, bad_target, valid, valid)], sparse=False)
        assert torch.isnan(kl), kl


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
