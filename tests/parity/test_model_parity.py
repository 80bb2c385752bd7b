"""Whole-model checks: logits vs transformers glm5_next, packed == per-document, indexer/mHC invariants, counts."""

from __future__ import annotations

import pytest
import torch

from torchtitan_glm.models import glm5
from torchtitan_glm.models.glm5 import Glm5Model, count_params, get_flavor
from torchtitan_glm.models.glm5.batch import BatchLayout
from torchtitan_glm.models.glm5.dsa import DocLayout, SparseMLA, causal_doc_mask
from torchtitan_glm.models.glm5.mhc import sinkhorn
from torchtitan_glm.models.glm5.seqinfo import doc_positions

from .hf_reference import assert_close, hf_config, indices_to_mask, our_args, randomize_, tiny_text_config

transformers = pytest.importorskip("transformers")


def _hf_full_model(**overrides):
    cfg = transformers.Glm5NextConfig(
        text_config=tiny_text_config(**overrides),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
                           projection_intermediate_size=32),
    )
    model = transformers.Glm5NextForConditionalGeneration(cfg).eval()
    return randomize_(model, seed=sum(map(ord, repr(sorted(overrides.items())))))


@pytest.mark.parametrize(
    "overrides,seqlens",
    [
        (dict(hc_mult=4, index_kpool=4, index_topk=8), (13, 40)),
        (dict(hc_mult=2, index_kpool=2, index_topk=6), (31,)),
        (dict(hc_mult=1, index_kpool=4, index_topk=16, linear_num_heads=2, linear_head_dim=32), (67,)),
    ],
)
def test_logits_match_transformers_via_save_pretrained(tmp_path, overrides, seqlens):
    hf = _hf_full_model(**overrides)
    hf.save_pretrained(tmp_path / "hf")
    ours = glm5.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    for seqlen in seqlens:
        ids = torch.randint(0, 128, (2, seqlen), generator=torch.Generator().manual_seed(seqlen))
        with torch.no_grad():
            expected = hf(input_ids=ids).logits
            got = ours.logits(ids)
        assert_close(got, expected)


def _tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    args = our_args(hf_config(**overrides), num_nextn_predict_layers=1)
    return randomize_(Glm5Model(args), seed=seed).eval()


def test_packed_equals_per_document():
    model = _tiny_model(seed=1, index_topk=8, index_kpool=4, hc_mult=2)
    lengths = [5, 17, 9, 33]
    docs = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    packed = torch.cat(docs, dim=1)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    with torch.no_grad():
        out = model.hidden_states(packed, cu)
        pieces = [model.hidden_states(d) for d in docs]
    assert_close(out.hidden, torch.cat([p.hidden for p in pieces], dim=1))
    # MTP at a document's last token sees the next document's first token: compare all other positions.
    for start, n, piece in zip(cu[:-1].tolist(), lengths, pieces):
        assert_close(out.mtp_hidden[:, start:start + n - 1], piece.mtp_hidden[:, : n - 1])
    # doc_ids form for B > 1 rows gives the same as cu_seqlens on each row.
    doc_ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths)).unsqueeze(0)
    with torch.no_grad():
        batched = model.hidden_states(packed.repeat(2, 1), doc_ids=doc_ids.repeat(2, 1))
    assert_close(batched.hidden[1:], out.hidden)


def test_indexer_selection_is_causal_and_keeps_tail():
    cfg = hf_config(index_topk=8, index_kpool=4)
    attn = randomize_(SparseMLA(our_args(cfg)), seed=7)
    lengths = torch.tensor([23, 41])
    doc_ids = torch.repeat_interleave(torch.arange(2), lengths).unsqueeze(0)
    doc = DocLayout(*doc_positions(doc_ids, 1, 64, torch.device("cpu")))
    with torch.no_grad():
        _, indices, _ = attn(torch.randn(1, 64, 64), BatchLayout(doc, doc_ids))
    assert indices.shape == (1, 64, 8 + 4 - 1)
    valid = indices[indices >= 0].long()
    assert len(set(zip(*[x.tolist() for x in torch.nonzero(indices >= 0, as_tuple=True)[:2]], valid.tolist()))) \
        == valid.numel(), "a query's indices repeat a token"
    mask = indices_to_mask(indices)
    allowed = causal_doc_mask(doc)
    assert not (mask & ~allowed).any(), "a query attends to a future token or another document"
    pos = doc.pos[0]
    for t in range(64):
        tail = int((pos[t] + 1) % 4)
        assert mask[0, t, t - tail + 1: t + 1].all(), f"query {t} misses its incomplete tail"
        assert mask[0, t].sum() <= 8 + 4 - 1
    assert not mask.all(), "sparse selection did not engage"


def test_sinkhorn_is_doubly_stochastic():
    comb = sinkhorn(torch.randn(5, 7, 4, 4), iters=20, eps=1e-6)
    assert torch.allclose(comb.sum(-1), torch.ones(5, 7, 4), atol=1e-3)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 7, 4), atol=1e-5)
    assert (comb > 0).all()


def test_param_counts_match_transformers():
    hf = _hf_full_model()
    ours = _tiny_model()
    text = sum(p.numel() for n, p in hf.named_parameters() if not n.startswith("model.visual"))
    mtp = sum(p.numel() for p in ours.mtp.parameters())
    total, active = count_params(ours)
    assert total == text + mtp
    e, k = 8, 2
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    experts += sum(p.numel() for p in ours.mtp.mlp.experts.parameters())
    assert active == total - experts + experts * k // e


def test_full_flavor_on_meta_device():
    args = get_flavor("glm5_3_flash")
    with torch.device("meta"):
        model = Glm5Model(args)
    assert all(p.is_meta for p in model.parameters())
    assert sum(a == "indexed_attention" for a in args.layer_types) == 11 and len(args.layer_types) == 45
    total, active = count_params(model)
    with torch.device("meta"):
        ref = transformers.models.glm5_next.modeling_glm5_next.Glm5NextTextModel(
            transformers.Glm5NextTextConfig(index_kpool=args.index_kpool))
    ref_total = sum(p.numel() for p in ref.parameters()) + args.vocab_size * args.hidden_size  # + lm_head
    mtp = sum(p.numel() for p in model.mtp.parameters())
    assert total == ref_total + mtp
    assert 1e9 < active < total
