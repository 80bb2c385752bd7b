"""activation_checkpoint.offload_inputs on the GPU (issue 11): the debug model in BF16 at T = 4096 under full AC gives
the same loss and gradients with its blocks' saved inputs in pinned host memory, and holds at least their bytes less
on the device between forward and backward. The CPU counterpart is tests/unit/test_offload_inputs.py."""

from __future__ import annotations

import pytest
import torch

from tests.compile.builders import build_model, make_batch, train_forward, training_loss
from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SEQ = 4096


def _run(offload: bool):
    model = build_model(0).cuda().to(torch.bfloat16)
    apply_activation_checkpointing(model, mode="full", offload_inputs=offload)
    batch = make_batch(0, model.args.vocab_size, bsz=1, seqlen=SEQ)
    batch = type(batch)(*(t.cuda() for t in batch))
    n = int((batch.labels != -100).sum())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = training_loss(train_forward(model, batch, token_scale=1.0 / n, mtp_scale=0.1 / n))
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # an allocation lets the allocator release blocks whose side-stream copies ended
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    grads = {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None}
    offloaded = model.block_offload.offloaded_bytes if offload else 0
    return loss.detach().float(), grads, held, offloaded


def test_offloaded_inputs_same_numbers_less_device_memory():
    loss, grads, held, _ = _run(False)
    loss_o, grads_o, held_o, moved = _run(True)
    torch.testing.assert_close(loss_o, loss, rtol=1e-5, atol=0)
    for k, g in grads.items():  # the same kernels on the same inputs, up to the order of FP32 atomic adds
        torch.testing.assert_close(grads_o[k], g, rtol=2e-2, atol=1e-3 * float(g.abs().max()), msg=k)
    args = build_model(0).args
    streams = args.num_hidden_layers * SEQ * args.hc_mult * args.hidden_size * 2
    assert moved >= streams
    assert held - held_o >= 0.9 * streams, (held, held_o, streams)
