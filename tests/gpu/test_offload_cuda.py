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


def _rel_err(a: dict, b: dict) -> dict[str, float]:
    return {k: float((a[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for k, g in b.items()}


def test_offloaded_inputs_same_numbers_less_device_memory():
    """Deterministic algorithms where torch has them; what is left (kernels with FP32 atomic adds) is measured by
    a second run without offload, and offload may differ from the first run by no more than twice that floor
    (bitwise, when the floor is zero): a copy back of the wrong or of unfinished host data changes gradients at
    order one."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        loss, grads, held, _ = _run(False)
        loss_2, grads_2, _, _ = _run(False)
        loss_o, grads_o, held_o, moved = _run(True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert grads_o.keys() == grads.keys()
    floor, err = _rel_err(grads_2, grads), _rel_err(grads_o, grads)
    table = "\n".join(f"{k}: offload {err[k]:.3e}, repeat {floor[k]:.3e}" for k in grads)
    print(f"loss {float(loss):.6f} repeat {float(loss_2):.6f} offload {float(loss_o):.6f}\n{table}")
    assert abs(float(loss_o - loss)) <= 2 * abs(float(loss_2 - loss)) + 1e-6 * abs(float(loss)), table
    bad = [k for k in grads if err[k] > 2 * floor[k] + 1e-6]
    assert not bad, f"offload differs more than twice the run-to-run floor in {bad}\n{table}"
    args = build_model(0).args
    streams = args.num_hidden_layers * SEQ * args.hc_mult * args.hidden_size * 2
    assert moved >= streams
    assert held - held_o >= 0.9 * streams, (held, held_o, streams)


def _packed(compiled: bool) -> tuple[list, float]:
    """(shape, dtype) of every tensor one training step offloads, and the loss; blocks compiled with inductor as the
    trainer compiles them, MoE in two checkpointed token chunks as the long-context runs use it (each chunk is one
    more region inductor compiles)."""
    from torchtitan_glm.compile import apply_compile

    model = build_model(0).cuda().to(torch.bfloat16)
    apply_activation_checkpointing(model, mode="full", offload_inputs=True, moe_chunk_tokens=SEQ // 2)
    if compiled:
        apply_compile(model, backend="inductor", components=["model", "loss"])
    packed = []
    pack = model.block_offload._pack

    def spy(t):
        out = pack(t)
        if isinstance(out, tuple):
            packed.append((tuple(t.shape), t.dtype))
        return out

    model.block_offload._pack = spy
    batch = make_batch(0, model.args.vocab_size, bsz=1, seqlen=SEQ)
    batch = type(batch)(*(t.cuda() for t in batch))
    n = int((batch.labels != -100).sum())
    loss = training_loss(train_forward(model, batch, token_scale=1.0 / n, mtp_scale=0.1 / n))
    loss.backward()
    torch.cuda.synchronize()
    return packed, float(loss)


def test_compiled_blocks_offload_what_eager_blocks_offload():
    """Inductor's partition of a fully checkpointed block saves its inputs only, so the host copies are the same
    tensors as in eager (plus the small int64 document inputs and the router's bias). Without
    activation_checkpoint.for_compile, torch 2.11 also saved the outputs of the blocks' autograd.Functions
    (docs/performance.md, thirty-first session)."""
    eager, loss = _packed(False)
    compiled, loss_c = _packed(True)
    big = lambda packed: sorted((s, str(d)) for s, d in packed if torch.Size(s).numel() >= SEQ * 64)  # noqa: E731
    print("eager:", big(eager), "\ncompiled:", big(compiled))
    assert big(compiled) == big(eager)
    assert abs(loss_c - loss) <= 1e-2 * abs(loss)
