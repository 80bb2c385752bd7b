"""Compiled (aot_eager), with and without activation checkpointing, gives the eager model's loss and gradients."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.compile import apply_compile

from .builders import (
    assert_close, assert_grads_close, make_batch, train_forward, training_loss, twin_models,
)
from .graph_ops import op_histogram

AC_OP = "torch.ops.higher_order.tag_activation_checkpoint"
CONV_OP = "torch.ops.torchtitan_glm.causal_conv_silu_fwd"


@pytest.mark.parametrize("ac_mode,sparse_kl", [
    pytest.param("none", False, marks=pytest.mark.slow), ("none", True),
    pytest.param("full", True, marks=pytest.mark.slow), ("selective", False)])  # slow ones: CI time
def test_compiled_matches_eager(ac_mode, sparse_kl):
    counter = CompileCounterWithBackend("aot_eager")

    def prepare(model):  # parallelize_glm5's order: AC wrappers first, then per-block compile
        apply_activation_checkpointing(model, mode=ac_mode)
        apply_compile(model, backend=counter, components=["model", "loss"])

    eager, compiled = twin_models(seed=0, prepare=prepare)
    batch = make_batch(0, eager.args.vocab_size)
    n = batch.labels.numel()
    scales = dict(token_scale=torch.tensor(1.0 / n), mtp_scale=torch.tensor(0.1 / n))

    out = train_forward(compiled, batch, **scales, indexer_sparse_loss=sparse_kl)
    training_loss(out).backward()
    ref = train_forward(eager, batch, **scales, indexer_sparse_loss=sparse_kl)
    training_loss(ref).backward()

    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counter.frame_count == 5, f"{counter.frame_count} graphs (expected one per block kind)"
    checkpointed = [AC_OP in op_histogram(gm) for gm in counter.graphs]
    if ac_mode == "none":  # no checkpointed region; the KDA blocks' three short convs are an opaque op each
        assert not any(checkpointed), checkpointed
        convs = sorted(op_histogram(gm).get(CONV_OP, 0) for gm in counter.graphs)
        assert convs == [0, 0, 0, 3, 3], convs
    else:  # every decoder/MTP graph holds its body as a checkpointed region; the LM head is not wrapped
        assert sum(checkpointed) == counter.frame_count - 1, f"checkpointed graphs: {checkpointed}"

    assert_close(out.loss, ref.loss, "loss")
    assert_close(out.ce, ref.ce, "per-token CE")
    assert_close(out.mtp_ce, ref.mtp_ce, "per-token MTP CE")
    for i, (s, r) in enumerate(zip(out.moe_stats, ref.moe_stats)):
        assert torch.equal(s.counts, r.counts), f"MoE layer {i} routed differently"
    assert len(out.indexer_stats) == len(ref.indexer_stats) == 2
    for i, (s, r) in enumerate(zip(out.indexer_stats, ref.indexer_stats)):
        assert torch.equal(s.rows, r.rows) and s.rows > 0, f"DSA layer {i}: KL over different queries"
        assert_close(s.kl_sum, r.kl_sum, f"indexer {i} KL")
    assert_grads_close(compiled, eager)
