"""Inductor smoke test: a KDA+dense decoder layer (fp32; no MoE, whose native grouped GEMM wants bf16 under
inductor on CPU) compiles whole with the production backend and matches eager."""

from __future__ import annotations

import copy

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from .builders import assert_close, block_inputs, block_loss, block_of, build_model, clone_inputs, output_tensors


def test_kda_dense_layer_inductor_matches_eager():
    model = build_model(seed=0)
    block = block_of(model, "kda_dense")
    reference = copy.deepcopy(block)
    inputs = block_inputs(model, "kda_dense")
    ref_inputs = clone_inputs(inputs)

    counter = CompileCounterWithBackend("inductor")
    out = torch.compile(block, fullgraph=True, backend=counter)(*inputs[0], **inputs[1])
    block_loss(out).backward()
    ref = reference(*ref_inputs[0], **ref_inputs[1])
    block_loss(ref).backward()

    assert counter.frame_count == 1 and not counters["graph_break"]
    # Inductor fuses and reorders reductions (Sinkhorn's 20 normalisations amplify that): 1e-4 of the magnitude.
    for i, (got, want) in enumerate(zip(output_tensors(out), output_tensors(ref))):
        assert_close(got, want, f"output {i}", rtol=1e-4)
    streams, ref_streams = inputs[0][0], ref_inputs[0][0]
    assert_close(streams.grad, ref_streams.grad, "d streams", rtol=1e-4)
    grads = dict(reference.named_parameters())
    scale = max(p.grad.abs().max().item() for p in grads.values())
    for name, p in block.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f"{name}: missing or non-finite gradient"
        assert_close(p.grad, grads[name].grad, f"grad {name}", rtol=1e-4, atol=1e-6 * scale)
