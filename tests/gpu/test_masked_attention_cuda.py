"""FlexAttention under the mask (model.dsa_masked_kernel "flex", the default on CUDA under compile) against masked
SDPA on CUDA: forward and gradients at the DSA layer's head shape, and the proxy-shaped DSA block compiled with
inductor, selective AC, one compile for two selections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_glm.activation_checkpoint import wrap_block
from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.models.glm5.batch import BatchLayout
from torchtitan_glm.models.glm5.dsa import DocLayout, SparseMLA, causal_doc_mask
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops.masked_attention import masked_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _doc(bsz: int, seqlen: int) -> DocLayout:
    t = torch.arange(seqlen, device="cuda")
    doc_ids = ((t >= seqlen // 3).long() + (t >= seqlen // 2 + 77).long()).expand(bsz, seqlen)
    return DocLayout(*doc_positions(doc_ids, bsz, seqlen, torch.device("cuda")))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_flex_equals_masked_sdpa_forward_and_backward(dtype, tol):
    """64 heads of qk = v = 256 (the DSA layer's), T = 1000 (not a tile multiple), three documents, a random
    subset of each query's past: output and dq, dk, dv of flex (compiled) against SDPA computed in fp64."""
    bsz, heads, seqlen, dim = 1, 64, 1000, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    mask = causal_doc_mask(_doc(bsz, seqlen))
    keep = torch.rand(bsz, seqlen, seqlen, generator=gen, device="cuda") < 0.5
    keep[:, : seqlen // 4] = True
    keep |= torch.eye(seqlen, dtype=torch.bool, device="cuda")
    mask &= keep
    q, k, v = (torch.randn(bsz, heads, seqlen, dim, generator=gen, device="cuda").to(dtype).requires_grad_()
               for _ in range(3))
    grad_out = torch.randn(bsz, heads, seqlen, dim, generator=gen, device="cuda").to(dtype)
    scale = dim**-0.5

    def run(fn, *inputs):
        out = fn(*inputs)
        return (out, *torch.autograd.grad(out, inputs, grad_out.to(out.dtype)))

    ref = run(lambda *t: F.scaled_dot_product_attention(*t, attn_mask=mask.unsqueeze(1), scale=scale),
              *(t.detach().double().requires_grad_() for t in (q, k, v)))
    flex = run(torch.compile(lambda *t: masked_attention(*t, mask, scale=scale, kernel="flex"), fullgraph=True),
               q, k, v)
    for name, got, want in zip(("out", "dq", "dk", "dv"), flex, ref):
        err = (got.double() - want).abs().max().item() / want.abs().max().item()
        assert err < tol, f"{name}: max error {err:.2e} of the largest value (tolerance {tol:.0e})"


def test_compiled_dsa_block_flex_equals_sdpa_with_selective_ac():
    """The DSA block at the proxy's head shapes (64 heads, latent 512, top-k 2048 of pools of 4) over a row of
    2,560 tokens in the selection-as-mask path, fp32, compiled with inductor under selective AC: "auto" (flex)
    equals "sdpa" in output, KL and every gradient; a second selection reuses the compiled graph."""
    args = get_flavor("glm5_3_flash_proxy").replace(hidden_size=512, dsa_dense_max_len=4096)
    seqlen = 2560
    doc = _doc(1, seqlen)
    results = {}
    for kernel in ("sdpa", "auto"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            attn = SparseMLA(args.replace(dsa_masked_kernel=kernel))
            attn.init_weights()
        block = torch.compile(wrap_block(attn, mode="selective"), fullgraph=True)
        torch._dynamo.utils.counters.clear()
        runs = []
        for seed in (1, 2):
            x = torch.randn(1, seqlen, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            x.requires_grad_()
            out, idx, stats = block(x, BatchLayout(doc, None, None, "sparse", False))
            loss = out.square().mean() + stats.kl_sum / stats.rows
            grads = torch.autograd.grad(loss, [x, *(p for p in attn.parameters() if p.requires_grad)])
            runs.append((out, idx, stats.kl_sum, grads))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        results[kernel] = runs
    for (o_s, i_s, kl_s, g_s), (o_f, i_f, kl_f, g_f) in zip(results["sdpa"], results["auto"]):
        assert torch.equal(i_s, i_f)
        torch.testing.assert_close(o_f, o_s, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kl_f, kl_s, rtol=1e-4, atol=1e-6)
        for a, b in zip(g_f, g_s):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
