"""What the compiled proxy KDA block keeps for its backward on CUDA (torch's partitioner there is the one that
matters): no FP32 tensor of the block's [B, T, heads x head_dim] width. The H200 run of 2026-12-05 (docs/performance.md,
eighteenth session) found nine, the short convs' FP32 intermediates, 1.1 GiB per layer at T = 4,096."""

from __future__ import annotations

import pytest
import torch

from tests.saved import saved_for_backward
from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.models.glm5.batch import BatchLayout
from torchtitan_glm.models.glm5.dsa import DocLayout
from torchtitan_glm.models.glm5.kda import KimiDeltaAttention
from torchtitan_glm.models.glm5.seqinfo import doc_positions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("docs", [False, True])
def test_compiled_kda_block_saves_no_fp32_activation_of_its_width(docs):
    args = get_flavor("glm5_3_flash_proxy")
    torch.manual_seed(0)
    with torch.device("cuda"):
        block = KimiDeltaAttention(args)
        block.init_weights()
    block.to(torch.bfloat16)
    seqlen, inner = 2048, args.linear_num_heads * args.linear_head_dim
    doc_ids = (torch.arange(seqlen, device="cuda") >= 700).long()[None] if docs else None
    batch = BatchLayout(DocLayout(*doc_positions(doc_ids, 1, seqlen, torch.device("cuda"))), doc_ids)
    x = torch.randn(1, seqlen, args.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    with saved_for_backward() as held:
        out = compiled(x, batch)
    wide_fp32 = [tuple(t.shape) for t in held if t.dtype == torch.float32 and t.numel() >= seqlen * inner]
    # the decay gate's FP32 output [B, T, H, K] is the KDA kernel's input (ops/kda.py): the only one allowed
    assert len(wide_fp32) <= 1, wide_fp32
    out.float().square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
