"""Incremental decode and generation against transformers glm5_next: greedy generation (transformers' own generate
with its cache) on a tiny random checkpoint written by transformers, and decode == the training forward on the
tiny parity configs' shapes."""

from __future__ import annotations

import pytest
import torch

from torchtitan_glm.generation import generate
from torchtitan_glm.models import glm5
from torchtitan_glm.models.glm5 import Glm5Model
from torchtitan_glm.models.glm5.decode import decode_step, prefill

from tests.decode_util import decoded_logits, max_rel_err, packed_logits, random_docs

from .hf_reference import assert_close, hf_config, our_args, randomize_, tiny_text_config

transformers = pytest.importorskip("transformers")

VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32)


@torch.no_grad()
def test_greedy_generation_matches_transformers(tmp_path):
    """A left-padded batch of prompts (4 to 24 tokens: mid-pool and at pool boundaries, longer than index_topk + kpool
    so the selection matters) through transformers' generate (greedy, its cache) and ours: the same tokens, and the
    same logits at every step."""
    cfg = transformers.Glm5NextConfig(text_config=tiny_text_config(index_topk=8, index_kpool=4), vision_config=VISION)
    hf = randomize_(transformers.Glm5NextForConditionalGeneration(cfg).eval(), seed=3)
    hf.save_pretrained(tmp_path / "hf")
    ours = glm5.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    width, new = 24, 16
    ids = torch.randint(0, 128, (5, width), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([19, 12, 4, 24, 13])
    mask = (torch.arange(width) >= width - lengths.unsqueeze(1)).long()
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None,
                      pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    got = generate(ours, ids, attention_mask=mask, max_new_tokens=new)
    assert torch.equal(got, ref.sequences)
    # The logits of each step, through prefill + decode_step on the same tokens.
    hidden, state = prefill(ours, ids, lengths=lengths, capacity=width + new)
    steps = [ours.lm_head(hidden[:, -1])]
    for s in range(new - 1):
        steps.append(ours.lm_head(decode_step(ours, got[:, width + s], state)))
    assert_close(torch.stack(steps, 1), torch.stack(ref.logits, 1))


@pytest.mark.parametrize(
    "overrides",
    [
        dict(hc_mult=4, index_kpool=4, index_topk=8),
        dict(hc_mult=2, index_kpool=2, index_topk=6),
        dict(hc_mult=1, index_kpool=4, index_topk=16, linear_num_heads=2, linear_head_dim=32),
    ],
)
@torch.no_grad()
def test_decode_equals_packed_forward_on_parity_configs(overrides):
    """The tiny parity configs' shapes: documents packed in one training row vs separate prompts prefilled mid-pool
    and at pool boundaries then decoded token by token; logits at every position."""
    model = randomize_(Glm5Model(our_args(hf_config(**overrides), num_nextn_predict_layers=0)), seed=4).eval()
    lengths, prefill_lengths = [27, 21, 34, 8], [1, 4, 7, 2]
    docs = random_docs(lengths, 128, seed=5)
    assert max_rel_err(decoded_logits(model, docs, prefill_lengths), packed_logits(model, docs)) < 1e-5
