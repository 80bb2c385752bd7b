"""activation_checkpoint.moe_chunk_tokens (issue 11, long context): the routed experts over checkpointed token
chunks give the unchunked loss, gradients and routing statistics (fp32, CPU, every AC mode), run in chunks, and hold
fewer activation bytes between forward and backward. Compiled: tests/compile/test_recompute_compiled.py."""

from __future__ import annotations

import pytest
import torch

from tests.compile.builders import BATCH, SEQLEN, build_model, debug_args, make_batch, train_forward, training_loss
from tests.unit.test_recompute_modules import _Created
from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.config import ActivationCheckpointConfig, ConfigError, JobConfig
from torchtitan_glm.models.glm5.moe import GroupedExperts

CHUNK = 13  # 64 tokens -> chunks of 13, the last one of 12


def _step(mode: str, chunk: int, monkeypatch=None):
    model = build_model(0)
    apply_activation_checkpointing(model, mode=mode, moe_chunk_tokens=chunk)
    calls = []
    if monkeypatch is not None:
        orig = GroupedExperts.forward

        def spy(self, x_sorted, counts):
            calls.append(int(counts.sum()))
            return orig(self, x_sorted, counts)

        monkeypatch.setattr(GroupedExperts, "forward", spy)
    batch = make_batch(0, model.args.vocab_size)
    n = int((batch.labels != -100).sum())
    with _Created() as created:
        out = train_forward(model, batch, token_scale=1.0 / n, mtp_scale=0.1 / n)
        loss = training_loss(out)
    held = created.alive_bytes()
    counts = [s.counts.clone() for s in out.moe_stats]
    loss.backward()
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in model.named_parameters()
             if p.grad is not None}
    return loss.detach(), grads, counts, held, calls


@pytest.fixture(scope="module")
def unchunked():
    return _step("none", 0)


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_chunked_experts_match_unchunked(unchunked, mode, monkeypatch):
    ref_loss, ref_grads, ref_counts, _, _ = unchunked
    loss, grads, counts, _, calls = _step(mode, CHUNK, monkeypatch)
    top_k = debug_args().num_experts_per_tok
    tokens = BATCH * SEQLEN
    # forward ran the experts chunk by chunk (rows = chunk tokens x top-k), in every MoE layer
    first = calls[:-(-tokens // CHUNK)]
    assert first == [CHUNK * top_k] * (tokens // CHUNK) + [(tokens % CHUNK) * top_k], calls
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert len(counts) == len(ref_counts) and all(torch.equal(a, b) for a, b in zip(counts, ref_counts))
    assert grads.keys() == ref_grads.keys()
    for key, g in grads.items():
        torch.testing.assert_close(g, ref_grads[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_chunks_hold_fewer_bytes(unchunked):
    held_plain = unchunked[3]
    held_chunked = _step("none", CHUNK)[3]
    # chunks free the expert rows of all but one chunk: 9% of what the debug model holds here (its SwiGLU keeps gate
    # and up only)
    assert held_chunked < held_plain * 0.95, (held_chunked, held_plain)


def test_chunk_as_large_as_the_tokens_changes_nothing(unchunked, monkeypatch):
    loss, _, _, _, calls = _step("none", BATCH * SEQLEN, monkeypatch)
    assert calls and all(c == BATCH * SEQLEN * debug_args().num_experts_per_tok for c in calls)
    assert torch.equal(loss, unchunked[0])


def test_negative_chunk_is_a_config_error():
    with pytest.raises(ConfigError, match="activation_checkpoint.moe_chunk_tokens"):
        JobConfig(activation_checkpoint=ActivationCheckpointConfig(moe_chunk_tokens=-1)).validate()
    with pytest.raises(ValueError, match="moe_chunk_tokens"):
        apply_activation_checkpointing(build_model(0), mode="none", moe_chunk_tokens=-5)
