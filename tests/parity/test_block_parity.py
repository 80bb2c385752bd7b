"""Each block against its transformers glm5_next counterpart on random weights (CPU, fp32, 1e-5 relative)."""

from __future__ import annotations

import pytest
import torch

from torchtitan_glm.models.glm5.decoder import DecoderLayer
from torchtitan_glm.models.glm5.batch import BatchLayout
from torchtitan_glm.models.glm5.dsa import DocLayout, SparseMLA
from torchtitan_glm.models.glm5.kda import KimiDeltaAttention
from torchtitan_glm.models.glm5.layers import DenseMLP
from torchtitan_glm.models.glm5.mhc import HyperConnection
from torchtitan_glm.models.glm5.moe import MoE
from torchtitan_glm.models.glm5.seqinfo import doc_positions

from .hf_reference import assert_close, hf_config, hf_mod, indices_to_mask, load_from_hf, our_args, randomize_


def _doc(bsz: int, seqlen: int) -> DocLayout:
    return DocLayout(*doc_positions(None, bsz, seqlen, torch.device("cpu")))


@pytest.mark.parametrize("hc_mult", [1, 2, 4])
def test_hyper_connection(hc_mult):
    cfg = hf_config(hc_mult=hc_mult)
    ref = randomize_(hf_mod.Glm5NextTextHyperConnection(cfg), seed=hc_mult)
    ours = HyperConnection(hidden_size=64, hc_mult=hc_mult, sinkhorn_iters=cfg.hc_sinkhorn_iters,
                           hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
    load_from_hf(ours, ref)
    # Embedding-like inputs with per-token RMS below sqrt(eps): eps placement inside the sqrt matters here.
    streams = (torch.randn(2, 9, hc_mult, 64)
               * torch.tensor([1.0, 1e-3]).repeat_interleave(torch.tensor([5, 4])).view(1, 9, 1, 1))
    for r, o in zip(ref(streams), ours(streams)):
        assert_close(o, r)


@pytest.mark.parametrize("seqlen", [7, 64, 100])
def test_kda_block(seqlen):
    cfg = hf_config()
    ref = randomize_(hf_mod.Glm5NextTextLinearAttention(cfg, layer_idx=0), seed=seqlen)
    ours = KimiDeltaAttention(our_args(cfg))
    load_from_hf(ours, ref)
    x = torch.randn(2, seqlen, 64)
    with torch.no_grad():
        assert_close(ours(x, BatchLayout(_doc(2, seqlen), None)), ref(x))


@pytest.mark.parametrize(
    "kpool,topk,seqlen",
    [(4, 8, 5), (4, 8, 13), (4, 8, 40), (4, 16, 67), (2, 6, 33), (1, 8, 30), (16, 32, 100)],
)
def test_dsa_block(kpool, topk, seqlen):
    """Covers T below/above index_topk (sparse path engaged), T multiple or not of kpool, kpool 1..16."""
    cfg = hf_config(index_kpool=kpool, index_topk=topk)
    ref = randomize_(hf_mod.Glm5NextTextAttention(cfg, layer_idx=1), seed=kpool * 100 + seqlen).eval()
    ours = SparseMLA(our_args(cfg))
    load_from_hf(ours, ref)
    x = torch.randn(2, seqlen, 64)
    with torch.no_grad():
        expected, _, _ = ref(x, attention_mask=torch.ones(2, seqlen, dtype=torch.bool))
        got, indices, _ = ours(x, BatchLayout(_doc(2, seqlen), None))
    assert_close(got, expected)
    assert indices.shape == (2, seqlen, min(topk // kpool, seqlen // kpool) * kpool + kpool - 1)
    if seqlen > topk + kpool:
        causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
        assert not torch.equal(indices_to_mask(indices), causal.expand(2, -1, -1)), "sparse path did not engage"


def test_moe_and_dense_mlp():
    cfg = hf_config()
    ref = randomize_(hf_mod.Glm5NextTextMoE(cfg), seed=3)
    ours = MoE(our_args(cfg))
    load_from_hf(ours, ref)
    x = torch.randn(2, 21, 64) * 3  # large enough that the swiglu clamp engages for some rows
    with torch.no_grad():
        got, stats = ours(x)
        assert_close(got, ref(x))
    assert int(stats.counts.sum()) == 2 * 21 * cfg.num_experts_per_tok

    ref_mlp = randomize_(hf_mod.Glm5NextTextMLP(cfg), seed=4)
    ours_mlp = DenseMLP(64, cfg.intermediate_size, swiglu_limit=cfg.swiglu_limit)
    load_from_hf(ours_mlp, ref_mlp)
    with torch.no_grad():
        assert_close(ours_mlp(x), ref_mlp(x))


def test_grouped_routing_matches_reference():
    cfg = hf_config(n_group=4, topk_group=2, n_routed_experts=16, num_experts_per_tok=4)
    ref = randomize_(hf_mod.Glm5NextTextMoE(cfg), seed=5)
    ours = MoE(our_args(cfg))
    load_from_hf(ours, ref)
    x = torch.randn(3, 11, 64)
    with torch.no_grad():
        assert_close(ours(x)[0], ref(x))


@pytest.mark.parametrize("layer_idx", [0, 1, 3])
def test_decoder_layer(layer_idx):
    cfg = hf_config(hc_mult=4)
    ref = randomize_(hf_mod.Glm5NextTextDecoderLayer(cfg, layer_idx), seed=layer_idx).eval()
    ours = DecoderLayer(our_args(cfg), layer_idx)
    load_from_hf(ours, ref)
    streams = torch.randn(2, 29, 4, 64)
    with torch.no_grad():
        expected, _ = ref(streams, attention_mask=torch.ones(2, 29, dtype=torch.bool))
        got, *_ = ours(streams, BatchLayout(_doc(2, 29), None))
    assert_close(got, expected)
