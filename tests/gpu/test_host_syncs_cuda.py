"""No host sync in a training step on the GPU (issue 12): a non-log step of the debug trainer (fused AdamW, its
batch as the loader yields it, on the host) runs under torch.cuda.set_sync_debug_mode("error"), which raises at any
call that blocks the host on the device (.item(), a device-to-host copy, a value-dependent shape, a blocking
host-to-device copy). The CPU counterpart, which counts reads through dispatch modes, is tests/unit/test_host_syncs.py.
Passed on the H200 (2026-12-03)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.compile.builders import build_model, doc_ids_for
from tests.gpu.test_kda_fla import _fla_usable
from tests.unit.test_host_syncs import _trainer
from torchtitan_glm.models.glm5.decode import prefill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("accumulate,optimizer", [
    ((), ("--optimizer.implementation", "fused")),
    (("--training.global_batch_size", "2", "--parallelism.fsdp_reshard_after_forward", "never"),
     ("--optimizer.implementation", "fused")),
    ((), ("--optimizer.name", "AdamW8bit", "--optimizer.implementation", "fused", "--training.on_nonfinite", "skip")),
], ids=["one_batch", "two_microbatches", "adamw8bit_fused_skip"])
def test_a_training_step_does_not_sync(tmp_path, world_of_one, accumulate, optimizer):
    """Also a step of two accumulated microbatches (FSDP2's deferred reduce and held gathers), and AdamW8bit's fused
    step skipping on the device (its step counts there, torchao's lr a host tensor)."""
    trainer = _trainer(tmp_path, "--training.steps", "3", "--metrics.log_freq", "100", *optimizer,
                       "--training.mixed_precision_param", "bfloat16", *accumulate)
    assert trainer.device.type == "cuda" and trainer.device_skip
    trainer.model.train()
    trainer.step = 1
    trainer.train_step(*trainer.next_batches())  # first step: lazy state, kernel autotuning
    batches, documents = trainer.next_batches()  # on the host, as the loader yields them: copied without blocking
    torch.cuda.synchronize()
    trainer.step = 2
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_step(batches, documents)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    metrics = trainer.stats.resolve(2)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["loss"])) and not m["nonfinite"] for m in metrics)



def _count_syncs(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(synchronising calls fn makes, as torch.cuda.set_sync_debug_mode("warn") reports them; fn's result), run
    without gradients after the device is idle."""
    torch.cuda.synchronize()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught), out


@pytest.mark.skipif(not _fla_usable(), reason="needs fla-core with triton")
def test_device_document_ids_are_copied_to_the_host_once_per_forward():
    """Document ids given only on the device (scripts, a decode prefill) are copied to the host once, in
    batch_layout, for the whole forward; the KDA layers then build their varlen layout from that copy instead of
    each copying the ids back itself. Counted as synchronising calls: the forward with device ids makes exactly one
    more than the same forward given the host copy, whatever the number of KDA layers."""
    model = build_model().cuda().eval()
    assert sum(not layer.is_dsa for layer in model.layers.values()) >= 2  # KDA layers
    host = doc_ids_for(1)
    tokens = torch.randint(0, model.args.vocab_size, host.shape, device="cuda")

    def forward(**ids):
        return model.hidden_states(tokens, with_mtp=False, **ids).hidden

    _count_syncs(lambda: forward(doc_ids=host.cuda(), host_doc_ids=host))  # first call: autotuning, lazy state
    given, expected = _count_syncs(lambda: forward(doc_ids=host.cuda(), host_doc_ids=host))
    device_only, hidden = _count_syncs(lambda: forward(doc_ids=host.cuda()))
    assert device_only == given + 1, (device_only, given)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)


@pytest.mark.skipif(not _fla_usable(), reason="needs fla-core with triton")
def test_decode_prefill_copies_its_padding_ids_to_the_host_once():
    """The decode prefill of left-padded prompts gives the padding its own document id, on the device; its KDA layers
    read batch_layout's one host copy, so padded prompts cost one synchronising call more than unpadded ones."""
    model = build_model().cuda().eval()
    tokens = torch.randint(0, model.args.vocab_size, (2, 64), device="cuda")

    def syncs(lengths: list[int]) -> int:
        lengths = torch.tensor(lengths, device="cuda")
        return _count_syncs(lambda: prefill(model, tokens, lengths=lengths, capacity=80))[0]

    syncs([64, 64]), syncs([64, 40])  # first calls: autotuning, lazy state
    assert syncs([64, 40]) == syncs([64, 64]) + 1
