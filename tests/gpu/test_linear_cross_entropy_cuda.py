"""The compiled fused CE at the proxy's vocabulary past 2^31 / vocab rows, against eager. Before the fix inductor
fused each chunk's target gather into one kernel over all rows, whose int32 offsets into the chunk logits overflowed:
an illegal memory access at 24,576 rows of 154,880 words on an H100 (pytorch/pytorch#189108; docs/performance.md,
twenty-eighth session)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from torchtitan_glm.ops.linear_cross_entropy import linear_cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and triton")]


def test_compiled_ce_at_many_rows_of_a_large_vocabulary_equals_eager():
    n, vocab, dim, chunk = 24_576, 154_880, 64, 4096  # 3 x 8,192 rows x 154,880 > 2^31
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, dim, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(vocab, dim, device="cuda", generator=gen) * 0.2).bfloat16()
    y = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    y[::7] = -100
    tw = torch.rand(n, device="cuda", generator=gen)

    def run(fn):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss, per_token = fn(hh, ww, y, tw)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), per_token, hh.grad, ww.grad

    def ce(hh, ww, yy, tt):
        return linear_cross_entropy(hh, ww, yy, tt, chunk_size=chunk)

    torch._dynamo.reset()
    compiled = run(torch.compile(ce, backend="inductor", fullgraph=True))
    eager = run(ce)
    assert torch.isfinite(compiled[1]).all() and float(compiled[1].max()) > 0
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)
