"""Inductor smoke tests: a KDA+dense decoder layer (fp32; no MoE, whose native grouped GEMM wants bf16 under
inductor on CPU) compiles whole with the production backend and matches eager, also in FP8 (the serving split: the
KDA projections kept, the MLP converted)."""

from __future__ import annotations

import copy

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from torchtitan_glm.config import Float8Config
from torchtitan_glm.float8 import convert_float8

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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_fp8_dense_layer_inductor_runs_fp8():
    """Inductor keeps the FP8 of Float8Linear (tensorwise): its forward and backward code call _scaled_mm, and the
    compiled layer computes the eager FP8 layer's numbers, which are FP8-far (~9%) from the layer without FP8."""
    from torch._inductor.utils import run_and_get_code

    model = build_model(seed=0)
    exact = copy.deepcopy(block_of(model, "kda_dense"))
    convert_float8(model, cfg=Float8Config(enable=True, recipe="tensorwise"))
    block = block_of(model, "kda_dense")
    inputs = block_inputs(model, "kda_dense")
    results = {}
    for name, layer in (("exact", exact), ("eager", copy.deepcopy(block))):
        args, kwargs = clone_inputs(inputs)
        block_loss(layer(*args, **kwargs)).backward()
        results[name] = {n: p.grad for n, p in layer.named_parameters()}

    def compiled_step():
        block_loss(torch.compile(block, fullgraph=True, backend="inductor")(*inputs[0], **inputs[1])).backward()

    _, codes = run_and_get_code(compiled_step)
    assert len(codes) == 2 and all("_scaled_mm" in code for code in codes), [c.count("_scaled_mm") for c in codes]
    got = {n: p.grad for n, p in block.named_parameters()}
    for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        fp8_error = _rel(results["eager"][name], results["exact"][name])
        assert fp8_error > 1e-2, (name, fp8_error)  # the FP8 rounding the comparison below must be able to see
        assert _rel(got[name], results["eager"][name]) < 1e-3, name  # CPU, 2026-12-08: equal to the last bit
