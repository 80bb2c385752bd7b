"""The precision controls of the Megatron GLM-5.3 PR, each against an fp64 computation: the serving FP8 indexer
input (Hadamard + E4M3 with power-of-two scales), mHC FP32 mixing, KPool FP32 accumulation, the indexer's FP32
head weights and key LayerNorm, a frozen KPool APE, and the learned stream contraction. Each knob must change what
it names and nothing else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_glm.components.loss import indexer_kl_loss
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.models.glm5.hf_io import _cast_for_load
from torchtitan_glm.models.glm5.dsa import DocLayout, KPoolIndexer, pool_layout
from torchtitan_glm.models.glm5.indexer_fp8 import fp8_serving_input, hadamard_transform, quantize_e4m3_pow2
from torchtitan_glm.models.glm5.mhc import HyperConnection
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops.indexer_topk import index_scores


def sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the E4M3 grid (3 mantissa bits, min normal 2^-6, max 448), in fp64, by hand."""
    a = v.abs()
    exp = torch.floor(torch.log2(a.clamp_min(2.0**-6)))
    quantum = torch.exp2(exp - 3)
    q = torch.round(a / quantum) * quantum  # torch.round is half-to-even
    return torch.sign(v) * q.clamp(max=448.0)


def serving_reference(x: torch.Tensor) -> torch.Tensor:
    """The serving description in fp64: rotate, round to BF16, pow2 row scale (amax floor 1e-4), clamp, E4M3."""
    d = x.shape[-1]
    rot = x.double() @ sylvester(d) * d**-0.5
    rot = rot.to(torch.bfloat16).double()
    amax = rot.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = 2.0 ** torch.ceil(torch.log2(amax / 448.0))
    return round_e4m3((rot / scale).clamp(-448, 448)) * scale


@pytest.mark.parametrize("d", [16, 128])
def test_hadamard_matches_explicit_matrix(d):
    x = torch.randn(5, 3, d, dtype=torch.float64)
    assert torch.allclose(hadamard_transform(x), x @ sylvester(d) * d**-0.5, rtol=0, atol=1e-12)


def test_fp8_input_matches_serving_description_and_passes_gradient_straight_through():
    torch.manual_seed(0)
    # Rows of very different magnitudes, one below the 1e-4 amax floor, one with an outlier.
    x = torch.randn(6, 128) * torch.tensor([1e-6, 1e-3, 1.0, 30.0, 1e3, 1.0]).view(6, 1)
    x[5, 7] = 500.0
    x.requires_grad_(True)
    out = fp8_serving_input(x)
    ref = serving_reference(x.detach())
    assert torch.equal(out.double(), ref)
    values, scale = quantize_e4m3_pow2(hadamard_transform(x.detach()).to(torch.bfloat16))
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
    assert values.float().abs().max() <= 448.0 and values.dtype == torch.float8_e4m3fn
    g = torch.randn_like(out)
    (out * g).sum().backward()
    # Straight through the rounding, through the (symmetric, orthogonal) rotation.
    assert torch.allclose(x.grad.double(), g.double() @ sylvester(128) * 128**-0.5, atol=1e-5)
    # Scores are what a serving FP8 dot product gives: the rotation cancels, only the rounding remains.
    q, k = torch.randn(4, 128), torch.randn(7, 128)
    s = fp8_serving_input(q) @ fp8_serving_input(k).t()
    assert torch.allclose(s.double(), serving_reference(q) @ serving_reference(k).t(), atol=1e-4)
    assert (s - q @ k.t()).abs().max() > 1e-3  # and the FP8 rounding is really there


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def test_mhc_fp32_mixing_rounds_once():
    torch.manual_seed(0)
    n, d = 4, 64
    kw = dict(hidden_size=d, hc_mult=n, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-5)
    base, fp32 = HyperConnection(**kw), HyperConnection(**kw, fp32_mixing=True)
    for hc in (base, fp32):
        torch.manual_seed(1)
        hc.init_weights()
    streams = torch.randn(2, 8, n, d).to(torch.bfloat16)
    block_out = torch.randn(2, 8, d).to(torch.bfloat16)
    outs_base, outs_fp32 = base(streams), fp32(streams)
    for a, b in zip(outs_base, outs_fp32):  # the knob leaves the mappings alone
        assert torch.equal(a, b)
    post, comb, _ = outs_base
    exact = post.double().unsqueeze(-1) * block_out.double().unsqueeze(-2) + torch.matmul(
        comb.double().transpose(-1, -2), streams.double())
    err_fp32 = (fp32.merge(streams, block_out, post, comb).double() - exact).abs()
    err_base = (base.merge(streams, block_out, post, comb).double() - exact).abs()
    assert (err_fp32 <= _bf16_ulp(exact) * 0.5 + 1e-6).all()  # one rounding of the FP32 result
    assert err_base.mean() > 1.5 * err_fp32.mean()  # BF16 mixing rounds post, comb and the partial sums


def test_mhc_fp32_mixing_reaches_every_block():
    """The [model] knob sets the two HyperConnections of every decoder block (the MTP layer has none), and in BF16
    it changes the model's output."""
    args = get_flavor("debug")
    torch.manual_seed(0)
    models = {knob: Glm5Model(args.replace(mhc_fp32_mixing=knob)).to(torch.bfloat16) for knob in (False, True)}
    models[True].load_state_dict(models[False].state_dict())
    for knob, model in models.items():
        hcs = [m for m in model.modules() if isinstance(m, HyperConnection)]
        assert len(hcs) == 2 * args.num_hidden_layers
        assert all(hc.fp32_mixing is knob for hc in hcs)
    tokens = torch.randint(0, args.vocab_size, (1, 24))
    logits = [models[knob].logits(tokens) for knob in (False, True)]
    assert not torch.equal(*logits)


def _indexer(**knobs) -> tuple[KPoolIndexer, torch.Tensor, torch.Tensor, object]:
    args = get_flavor("debug").replace(**knobs)
    torch.manual_seed(0)
    idx = KPoolIndexer(args)
    idx.init_weights()
    with torch.no_grad():  # a non-trivial gate and APE
        idx.index_kpool_compress_gate.normal_(0, 0.3)
        idx.kpool_ape.weight.normal_(0, 0.5)
        idx.k_norm.weight.normal_(1, 0.2)
        idx.k_norm.bias.normal_(0, 0.2)
    master = {n: p.detach().clone() for n, p in idx.named_parameters()}
    _cast_for_load(idx, torch.bfloat16)  # BF16, except keep_fp32 modules (APE; k_norm with indexer_k_norm_fp32)
    idx.master = master
    x = torch.randn(2, 32, args.hidden_size).to(torch.bfloat16)
    qr = torch.randn(2, 32, args.q_lora_rank).to(torch.bfloat16)
    pos, length, key = doc_positions(None, 2, 32, x.device)
    return idx, x, qr, pool_layout(DocLayout(pos, length, key), args.index_kpool)


def _pooled_fp64(idx: KPoolIndexer, x: torch.Tensor, pools, *, k: torch.Tensor) -> torch.Tensor:
    gate = F.linear(x, idx.index_kpool_compress_gate).double()  # the gate GEMM runs in the model dtype
    slots = (pools.start.unsqueeze(-1) + torch.arange(idx.kpool)).clamp(max=x.shape[1] - 1)
    rows = torch.arange(x.shape[0]).view(-1, 1, 1)
    probs = (gate[rows, slots] + idx.kpool_ape.weight.double()).softmax(2)
    return (probs * k.double()[rows, slots]).sum(2)


def test_kpool_fp32_accumulate_rounds_once():
    base, x, _, pools = _indexer()
    fp32, *_ = _indexer(kpool_fp32_accumulate=True)
    k = base.k_norm(base.wk(x))
    exact = _pooled_fp64(base, x, pools, k=k)
    err_fp32 = (fp32.pooled_keys(x, pools).double() - exact).abs()
    err_base = (base.pooled_keys(x, pools).double() - exact).abs()
    assert (err_fp32 <= _bf16_ulp(exact) * 0.5 + 1e-6).all()
    assert err_base.mean() > 1.5 * err_fp32.mean()
    assert torch.equal(fp32.head_weights(x), base.head_weights(x))  # nothing else moves


def test_indexer_k_norm_fp32():
    base, x, _, pools = _indexer(kpool_fp32_accumulate=True)
    fp32, *_ = _indexer(kpool_fp32_accumulate=True, indexer_k_norm_fp32=True)
    assert fp32.k_norm.weight.dtype == torch.float32 and base.k_norm.weight.dtype == torch.bfloat16
    w, b = (base.master[f"k_norm.{n}"].double() for n in ("weight", "bias"))  # the FP32 master values
    k_exact = F.layer_norm(base.wk(x).double(), (w.numel(),), w, b, base.k_norm.eps)
    exact = _pooled_fp64(base, x, pools, k=k_exact.to(torch.bfloat16))  # the normed key is rounded once
    err_fp32 = (fp32.pooled_keys(x, pools).double() - exact).abs()
    err_base = (base.pooled_keys(x, pools).double() - exact).abs()
    assert (err_fp32 <= _bf16_ulp(exact) + 1e-6).all()
    assert err_base.mean() > 1.5 * err_fp32.mean()  # 2.0x on 2026-12-08
    assert torch.equal(fp32.head_weights(x), base.head_weights(x))  # nothing else moves


def test_indexer_weights_fp32():
    base, x, _, pools = _indexer()
    fp32, *_ = _indexer(indexer_weights_fp32=True)
    exact = x.double() @ base.weights_proj.weight.double().t() * base.n_heads**-0.5
    assert torch.allclose(fp32.head_weights(x).double(), exact, rtol=1e-6, atol=1e-7)
    assert (base.head_weights(x).double() - exact).abs().max() > 1e-4  # BF16 projection before the cast
    assert fp32.weight_only_linears == {"weights_proj"} and base.weight_only_linears == set()
    assert torch.equal(fp32.pooled_keys(x, pools), base.pooled_keys(x, pools))  # nothing else moves


def test_indexer_fp8_emulation_scores():
    base, x, qr, pools = _indexer()
    emu, *_ = _indexer(indexer_fp8_emulation=True)
    q = base.wq_b(qr).unflatten(-1, (base.n_heads, base.head_dim))
    pooled = base.pooled_keys(x, pools)
    s = torch.einsum("bthd,bpd->bthp", serving_reference(q), serving_reference(pooled)) * base.head_dim**-0.5
    exact = (base.head_weights(x).double().unsqueeze(-1) * s.clamp_min(0)).sum(2)

    def scores(indexer):
        inp = indexer.inputs(x, qr, pools)
        return torch.stack([index_scores(inp.q[b], inp.w[b], inp.pk[b])[0] for b in range(x.shape[0])]).double()

    assert torch.allclose(scores(emu), exact, rtol=1e-5, atol=1e-5)
    assert (scores(base) - exact).abs().max() > 1e-4
    # nothing else moves: the emulation is applied to the score's inputs, not to the pooled keys or head weights
    assert torch.equal(emu.pooled_keys(x, pools), pooled) and torch.equal(emu.head_weights(x), base.head_weights(x))


def test_frozen_kpool_ape_gets_no_gradient_and_nothing_else_changes():
    args = get_flavor("debug")
    torch.manual_seed(0)
    trained = Glm5Model(args)
    frozen = Glm5Model(args.replace(kpool_ape_trainable=False))
    frozen.load_state_dict(trained.state_dict())
    tokens = torch.randint(0, args.vocab_size, (1, 24))
    for m in (trained, frozen):
        out = m(tokens, labels=torch.roll(tokens, -1, 1), mtp_scale=0.1, indexer_kl="dense")
        (out.loss + indexer_kl_loss(out.indexer_stats)).backward()
    ape = [n for n, _ in frozen.named_parameters() if n.endswith("kpool_ape.weight")]
    assert ape and all(dict(frozen.named_parameters())[n].grad is None for n in ape)
    assert all(dict(trained.named_parameters())[n].grad.abs().sum() > 0 for n in ape)
    for (n, p), (_, q) in zip(trained.named_parameters(), frozen.named_parameters()):
        if n not in ape:
            assert torch.equal(p.grad, q.grad), n


def test_learned_hc_head_formula():
    args = get_flavor("debug").replace(hc_head="learned")
    torch.manual_seed(0)
    model = Glm5Model(args)
    with torch.no_grad():
        model.hc_head.base.normal_()
    head = model.hc_head
    streams = torch.randn(2, 5, args.hc_mult, args.hidden_size, dtype=torch.float64)
    flat = streams.flatten(-2)
    flat = flat / torch.sqrt(flat.square().mean(-1, keepdim=True) + args.rms_norm_eps)
    pre = torch.sigmoid(flat @ head.fn.double().t() * head.scale.double() + head.base.double()) + args.hc_eps
    want = (pre.unsqueeze(-1) * streams).sum(-2)
    assert torch.allclose(head(streams.float()).double(), want, rtol=1e-5, atol=1e-6)
    assert (want - streams.mean(-2)).abs().max() > 1e-3
