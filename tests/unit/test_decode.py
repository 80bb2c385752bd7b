"""Incremental decode (prefill + one token per step) against the training forward, fp32 on CPU: each block type and
the whole debug model, prompts ending mid-pool and at pool boundaries, longer than index_topk."""

from __future__ import annotations

import pytest
import torch

from torchtitan_glm.generation import generate, sample
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor
from torchtitan_glm.models.glm5.batch import batch_layout
from torchtitan_glm.models.glm5.decode import decode_step, indexer_fp8, prefill, prompt_lengths
from torchtitan_glm.models.glm5.dsa import SparseMLA
from torchtitan_glm.models.glm5.kda import KimiDeltaAttention

from tests.decode_util import decoded_logits, left_pad, max_rel_err, packed_logits, random_docs, randomize

TOL = 1e-5
# Documents longer than index_topk + kpool (so the indexer's selection matters), and prompt (prefill) lengths that
# end mid-pool (1, 3, 6) and at a pool boundary (4, 8) for kpool 4 (and 2); 1 < conv width - 1 as well.
LENGTHS = [29, 18, 11, 33, 24]
PREFILL = [1, 3, 4, 8, 6]


def _args(**changes):
    base = dict(index_topk=8, index_kpool=4, num_nextn_predict_layers=0)
    base.update(changes)
    return get_flavor("debug").replace(**base)


def _layout(lengths: torch.Tensor, width: int):
    doc_ids = (torch.arange(width) >= (width - lengths).unsqueeze(1)).long()
    return batch_layout(doc_ids, (len(lengths), width), torch.device("cpu"))


def _block_paths(block, xs: list[torch.Tensor], prefill_lengths: list[int], *, dsa: bool, shared=None):
    """(training outputs, decode outputs, training selections, decode selections) per document for a token mixer:
    forward over each document alone vs prefill of the left-padded prefixes then one decode step per token.
    `shared`: the previous DSA block of a 'shared' layer (its selection is passed on)."""
    ref, ref_sel = [], []
    for x in xs:
        batch = batch_layout(None, (1, x.shape[0]), x.device)
        if dsa:
            prev = shared(x[None], batch)[1] if shared is not None else None
            out, indices, _ = block(x[None], batch, prev)
            ref.append(out[0])
            ref_sel.append(None if indices is None else indices[0])
        else:
            ref.append(block(x[None], batch)[0])
    lengths = torch.tensor(prefill_lengths)
    width = int(lengths.max())
    steps = max(x.shape[0] - p for x, p in zip(xs, prefill_lengths))
    padded = torch.randn(len(xs), width, xs[0].shape[-1])  # padding content must never reach the prompts
    for b, (x, p) in enumerate(zip(xs, prefill_lengths)):
        padded[b, width - p:] = x[:p]
    batch = _layout(lengths, width)
    if dsa:
        prev, prev_cache = None, None
        if shared is not None:
            _, prev, prev_cache = shared.prefill(padded, batch, capacity=width + steps)
        out, _, cache = block.prefill(padded, batch, prev, capacity=width + steps)
    else:
        out, cache = block.prefill(padded, batch)
    got = [[out[b, width - p:]] for b, p in enumerate(prefill_lengths)]
    got_sel = [[] for _ in xs]
    pos = lengths.clone()
    for s in range(steps):
        x = torch.stack([x[min(p + s, x.shape[0] - 1)] for x, p in zip(xs, prefill_lengths)]).unsqueeze(1)
        if dsa:
            prev = shared.decode(x, prev_cache, pos)[1] if shared is not None else None
            o, indices = block.decode(x, cache, pos, prev)
        else:
            o, indices = block.decode(x, cache, pos), None
        for b, (xd, p) in enumerate(zip(xs, prefill_lengths)):
            if p + s < xd.shape[0]:
                got[b].append(o[b])
                if indices is not None:
                    got_sel[b].append(indices[b, 0])
        pos += 1
    return ref, [torch.cat(g) for g in got], ref_sel, got_sel


def _as_set(indices: torch.Tensor) -> set[int]:
    return set(indices[indices >= 0].tolist())


@torch.no_grad()
def test_kda_block_decode_equals_forward():
    args = _args(linear_conv_kernel_dim=4)
    block = randomize(KimiDeltaAttention(args), seed=1, scale=0.2)
    xs = [torch.randn(n, args.hidden_size, generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    ref, got, _, _ = _block_paths(block, xs, PREFILL, dsa=False)
    assert max_rel_err(got, ref) < TOL


@pytest.mark.parametrize("changes", [
    dict(),  # kpool 4, top-8: 2 pools + the tail
    dict(index_kpool=2, index_topk=6, index_kpool_always_select_tail=False),
    dict(indexer_fp8_emulation=True, kpool_fp32_accumulate=True, indexer_weights_fp32=True),
    dict(dsa_attention="dense"),
], ids=["kpool4", "kpool2_no_tail", "fp8_indexer", "dense_stage"])
@torch.no_grad()
def test_dsa_block_decode_equals_forward(changes):
    args = _args(**changes)
    block = randomize(SparseMLA(args), seed=2, scale=0.3)
    xs = [torch.randn(n, args.hidden_size, generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    ref, got, ref_sel, got_sel = _block_paths(block, xs, PREFILL, dsa=True)
    assert max_rel_err(got, ref) < TOL
    if args.dsa_attention == "dense":
        return
    decoded = 0
    sparse = False
    for b, p in enumerate(PREFILL):
        for s, indices in enumerate(got_sel[b]):
            t = p + s
            assert _as_set(indices) == _as_set(ref_sel[b][t]), f"doc {b} position {t}: selections differ"
            sparse |= len(_as_set(indices)) < t + 1
            decoded += 1
    assert decoded == sum(LENGTHS) - sum(PREFILL) and sparse, "the sparse selection never engaged"


@torch.no_grad()
def test_shared_indexer_layer_decode_equals_forward():
    args = _args(layer_types=["linear_attention"] * 2 + ["indexed_attention"] * 2,
                 indexer_types=["full", "full", "full", "shared"])
    first = randomize(SparseMLA(args), seed=3, scale=0.3)
    second = randomize(SparseMLA(args, shared_indexer=True), seed=4, scale=0.3)
    xs = [torch.randn(n, args.hidden_size, generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    ref, got, _, _ = _block_paths(second, xs, PREFILL, dsa=True, shared=first)
    assert max_rel_err(got, ref) < TOL


@pytest.mark.parametrize("changes", [dict(), dict(hc_head="learned", mhc_fp32_mixing=True, index_topk=16)],
                         ids=["debug", "learned_hc_head"])
@torch.no_grad()
def test_model_decode_equals_packed_forward(changes):
    """The debug model (3 KDA + 1 DSA layer, dense MLP + MoE): documents packed in one training row vs each document
    a separate prompt, prefilled to PREFILL tokens then decoded token by token: logits at every position."""
    torch.manual_seed(0)
    model = randomize(Glm5Model(_args(**changes)), seed=5).eval()
    docs = random_docs(LENGTHS, model.args.vocab_size, seed=6)
    assert max_rel_err(decoded_logits(model, docs, PREFILL), packed_logits(model, docs)) < TOL


@torch.no_grad()
def test_decode_state_layout_and_capacity():
    model = randomize(Glm5Model(_args()), seed=7).eval()
    tokens, lengths = left_pad(random_docs([6, 3], model.args.vocab_size, seed=8))
    _, state = prefill(model, tokens, lengths=lengths, capacity=7)
    assert state.pos.tolist() == [6, 3]
    kda, mla = state.layers[0], state.layers[3]
    assert kda.state.dtype == torch.float32 and kda.state.shape == (2, 4, 16, 16)
    assert [c.shape for c in kda.conv] == [(2, 3, 64)] * 3
    assert mla.latent.shape == (2, 7, 16) and not mla.latent[1, 3:].any(), "padding or the future was cached"
    assert mla.indexer.pooled.shape == (2, 2, 16)
    assert mla.indexer.pooled[0, 0].any() and not mla.indexer.pooled[1].any(), "a pool of 3 tokens was cached"
    keys = mla.indexer.keys.abs().sum(-1) > 0  # the open pools: row 0 holds 6 = 4 + 2 tokens, row 1 holds 3
    assert keys.tolist() == [[True, True, False, False], [True, True, True, False]]
    decode_step(model, torch.tensor([1, 2]), state)
    assert mla.indexer.pooled[1, 0].any(), "the 4th token did not close the pool"
    with pytest.raises(ValueError, match="capacity"):
        decode_step(model, torch.tensor([1, 2]), state)
    with pytest.raises(ValueError, match="lengths"):
        prefill(model, tokens, lengths=torch.tensor([0, 3]), capacity=8)


def test_prompt_lengths_rejects_right_padding():
    assert prompt_lengths(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])).tolist() == [2, 4]
    with pytest.raises(ValueError, match="attention_mask rows \\[1\\]"):
        prompt_lengths(torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="attention_mask rows \\[0\\]"):
        prompt_lengths(torch.tensor([[0, 0, 0, 0]]))


@torch.no_grad()
def test_generate_greedy_matches_argmax_of_forward_and_padding():
    """Greedy: each new token is the argmax of the training forward's logits over the sequence so far, for every row
    of a left-padded batch; eos ends a row (pad after it)."""
    model = randomize(Glm5Model(_args()), seed=9).eval()
    prompts = random_docs([13, 5], model.args.vocab_size, seed=10)
    tokens, lengths = left_pad(prompts)
    mask = (torch.arange(tokens.shape[1]) >= tokens.shape[1] - lengths.unsqueeze(1)).long()
    out = generate(model, tokens, attention_mask=mask, max_new_tokens=6)
    assert out.shape == (2, 19) and torch.equal(out[:, :13], tokens)
    for b, p in enumerate(prompts):
        seq = torch.cat([p, out[b, 13:]])
        expected = model.logits(seq[None])[0, len(p) - 1:-1].argmax(-1)
        assert torch.equal(out[b, 13:], expected)
    eos = int(out[0, 15])
    stopped = generate(model, tokens, attention_mask=mask, max_new_tokens=6, eos_token_id=eos, pad_token_id=511)
    assert torch.equal(stopped[0, 13:16], out[0, 13:16]) and (stopped[0, 16:] == 511).all()


def test_sample_temperature_and_top_p():
    n = 20000  # frequencies within 0.015 (> 4 standard deviations)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * n)
    assert sample(logits).tolist() == [0] * n
    draws = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.015)
    probs = logits[0].softmax(-1)  # 0.61, 0.22, 0.14, 0.03: top_p 0.7 keeps the first two
    nucleus = sample(logits, temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(0))
    assert set(nucleus.tolist()) == {0, 1}
    assert abs(float((nucleus == 0).float().mean()) - float(probs[0] / probs[:2].sum())) < 0.015
    assert set(sample(logits, temperature=5.0, top_p=1e-6).tolist()) == {0}
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, temperature=-1.0)


@torch.no_grad()
def test_indexer_fp8_context_switches_the_decode_path():
    """indexer_fp8() turns serving's FP8 indexer on for every indexer (and restores it): decode under it equals the
    training forward of a model built with indexer_fp8_emulation."""
    plain = randomize(Glm5Model(_args()), seed=11).eval()
    emulated = Glm5Model(_args(indexer_fp8_emulation=True)).eval()
    emulated.load_state_dict(plain.state_dict())
    docs = random_docs([26, 21], plain.args.vocab_size, seed=12)
    with indexer_fp8(plain):
        got = decoded_logits(plain, docs, [4, 2])
    assert not plain.layers["3"].self_attn.indexer.fp8_emulation
    assert max_rel_err(got, packed_logits(emulated, docs)) < TOL
