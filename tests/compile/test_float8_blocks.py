"""The FP8 debug model (serving split, FP8 routed experts, every precision control on) compiles block by block with
fullgraph=True and no graph break, and the compiled blocks compute what the eager FP8 blocks compute."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from torchtitan_glm.config import Float8Config
from torchtitan_glm.float8 import convert_float8, cpu_scaled_mm_takes_row_scales

from .builders import assert_close, block_inputs, block_loss, block_of, build_model, clone_inputs, debug_args, \
    output_tensors

KNOBS = dict(indexer_fp8_emulation=True, mhc_fp32_mixing=True, kpool_fp32_accumulate=True, indexer_weights_fp32=True,
             indexer_k_norm_fp32=True, kpool_ape_trainable=False)


ROWWISE = pytest.mark.skipif(not cpu_scaled_mm_takes_row_scales(),
                             reason=f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only")


@pytest.mark.parametrize("name,recipe", [("kda_dense", "tensorwise"), pytest.param("kda_moe", "rowwise", marks=ROWWISE),
                                         ("dsa_moe", "tensorwise"), pytest.param("mtp", "rowwise", marks=ROWWISE)])
def test_fp8_block_compiles_whole(name, recipe):
    model = build_model(seed=0, args=debug_args(**KNOBS))
    summary = convert_float8(model, cfg=Float8Config(enable=True, recipe=recipe))
    assert summary.converted_linears > 0 and summary.grouped_expert_weights > 0
    block = block_of(model, name)
    reference = copy.deepcopy(block)
    inputs = block_inputs(model, name)
    ref_inputs = clone_inputs(inputs)
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(block, fullgraph=True, backend=counter)(*inputs[0], **inputs[1])
    block_loss(out).backward()
    assert counter.frame_count == 1 and not counters["graph_break"], dict(counters["graph_break"])
    ref_out = reference(*ref_inputs[0], **ref_inputs[1])
    block_loss(ref_out).backward()
    for i, (a, e) in enumerate(zip(output_tensors(out), output_tensors(ref_out))):
        assert_close(a, e, f"{name} output {i}")
    grads = {n: p.grad for n, p in block.named_parameters()}
    for n, p in reference.named_parameters():
        if p.grad is None:
            assert grads[n] is None, n
        else:
            assert_close(grads[n], p.grad, f"{name} grad {n}", atol=1e-6 * p.grad.abs().max().item())
