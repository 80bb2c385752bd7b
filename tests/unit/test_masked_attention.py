"""ops/masked_attention.py: FlexAttention under a BlockMask made from the [B, Tq, Tk] mask computes masked SDPA's
function (CPU: forward only, FlexAttention has no CPU backward; tests/gpu/test_masked_attention_cuda.py runs the
backward), and model.dsa_masked_kernel picks the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.models.glm5.args import ModelArgsError
from torchtitan_glm.models.glm5.batch import BatchLayout
from torchtitan_glm.models.glm5.dsa import DocLayout, SparseMLA, causal_doc_mask
from torchtitan_glm.models.glm5.seqinfo import doc_positions
from torchtitan_glm.ops.masked_attention import masked_attention, resolve_masked_kernel


def _selection_like_mask(bsz: int, tq: int, tk: int, seed: int) -> torch.Tensor:
    """Causal, two documents per row, a random subset of each query's past (every query keeps itself): empty,
    partial and full 128 x 128 tiles all occur."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(tk)
    doc = (t >= tk // 2).long().expand(bsz, tk)
    mask = causal_doc_mask(DocLayout(*doc_positions(doc, bsz, tk, torch.device("cpu"))))[:, tk - tq:]
    keep = torch.rand(bsz, tq, tk, generator=g) < 0.6
    keep[:, : tq // 4] = True  # the first queries keep their whole past: full tiles
    diag = torch.arange(tk - tq, tk)
    keep[:, torch.arange(tq), diag] = True
    return mask & keep


def _qkv(bsz, heads, tq, tk, dqk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(bsz, heads, tq, dqk, generator=g, dtype=torch.float64).float(),
            torch.randn(bsz, heads, tk, dqk, generator=g, dtype=torch.float64).float(),
            torch.randn(bsz, heads, tk, dv, generator=g, dtype=torch.float64).float())


@pytest.mark.parametrize("tq,tk", [(384, 384), (200, 200), (130, 390)])
def test_flex_equals_masked_sdpa_forward(tq, tk):
    """fp32, one process: eager flex (a compiled FlexAttention) and flex inside a compiled function equal SDPA under
    the same mask, for tiles of every kind, lengths not a multiple of the 128 tile, fewer queries than keys (a
    context-parallel rank's). Both flex calls compile once for two different masks of one shape."""
    q, k, v = _qkv(2, 3, tq, tk, 32, 16, seed=tq + tk)
    compiled = torch.compile(lambda q, k, v, m: masked_attention(q, k, v, m, scale=0.2, kernel="flex"),
                             fullgraph=True)
    for seed in (0, 1):
        mask = _selection_like_mask(2, tq, tk, seed)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=0.2)
        assert torch.equal(masked_attention(q, k, v, mask, scale=0.2, kernel="sdpa"), want)
        with torch.no_grad():
            torch.testing.assert_close(masked_attention(q, k, v, mask, scale=0.2, kernel="flex"), want,
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled(q, k, v, mask), want, rtol=1e-5, atol=1e-5)
    # a changed mask must change flex's answer (the BlockMask is rebuilt from it, not cached)
    mask = _selection_like_mask(2, tq, tk, 0)
    mask2 = mask.clone()
    mask2[:, -1, tk // 2: tk - 1] = False  # the last query's own document, but itself
    with torch.no_grad():
        a = masked_attention(q, k, v, mask, scale=0.2, kernel="flex")
        b = masked_attention(q, k, v, mask2, scale=0.2, kernel="flex")
    assert not torch.allclose(a[:, :, -1], b[:, :, -1])
    torch.testing.assert_close(a[:, :, :-1], b[:, :, :-1], rtol=0, atol=0)


def test_flex_refuses_cpu_backward_naming_the_key():
    q, k, v = _qkv(1, 1, 16, 16, 8, 8, seed=0)
    mask = torch.ones(1, 16, 16, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="dsa_masked_kernel='flex'"):
        masked_attention(q.requires_grad_(), k, v, mask, scale=1.0, kernel="flex")


def test_auto_is_flex_only_on_cuda_under_compile():
    assert resolve_masked_kernel("auto", torch.device("cpu")) == "sdpa"
    assert resolve_masked_kernel("auto", torch.device("cuda")) == "sdpa"  # eager: no per-shape compiles
    seen = []

    @torch.compile(fullgraph=True, backend="eager")
    def traced(x):
        seen.append((resolve_masked_kernel("auto", torch.device("cuda")),
                     resolve_masked_kernel("auto", torch.device("cpu"))))
        return x + 1

    traced(torch.zeros(1))
    assert seen == [("flex", "sdpa")]
    assert resolve_masked_kernel("sdpa", torch.device("cuda")) == "sdpa"
    assert resolve_masked_kernel("flex", torch.device("cpu")) == "flex"


def test_bad_kernel_name_is_an_error_naming_the_key():
    with pytest.raises(ModelArgsError, match="dsa_masked_kernel"):
        get_flavor("debug").replace(dsa_masked_kernel="cudnn")


@pytest.mark.parametrize("stage,kl", [("sparse", None), ("dense", "dense")])
def test_dsa_block_with_flex_equals_sdpa_compiled(stage, kl):
    """The SparseMLA block (selection as a mask, and the dense warm-up stage) with dsa_masked_kernel = "flex", under
    torch.compile with fullgraph, equals the "sdpa" block in fp32: the BlockMask and its mask_mod are built inside
    the compiled graph. Forward only, and through aot_eager: inductor's CPU FlexAttention template takes no views
    of the block's projections (the CUDA template does: tests/gpu/test_masked_attention_cuda.py)."""
    seqlen = 160
    t = torch.arange(seqlen)
    doc_ids = ((t >= 50).long() + (t >= 117).long()).expand(2, seqlen)
    doc = DocLayout(*doc_positions(doc_ids, 2, seqlen, torch.device("cpu")))
    x = torch.randn(2, seqlen, 64, dtype=torch.float64).float()
    outs = {}
    for kernel in ("sdpa", "flex"):
        torch.manual_seed(5)
        attn = SparseMLA(get_flavor("debug").replace(dsa_dense_max_len=seqlen, dsa_attention=stage,
                                                     dsa_masked_kernel=kernel))
        attn.init_weights()
        block = torch.compile(attn, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            outs[kernel] = block(x, BatchLayout(doc, None, None, kl, False))
    (o_s, i_s, st_s), (o_f, i_f, st_f) = outs["sdpa"], outs["flex"]
    assert (i_s is None) == (stage == "dense") and (i_s is None or torch.equal(i_s, i_f))
    torch.testing.assert_close(o_f, o_s, rtol=1e-5, atol=1e-6)
    if kl is not None:
        torch.testing.assert_close(st_f.kl_sum, st_s.kl_sum, rtol=1e-5, atol=1e-7)
