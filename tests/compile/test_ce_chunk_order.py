"""The fused CE compiled by inductor keeps one chunk's [chunk, vocab] tensors alive at a time (ops/order_after.py),
and order_after changes no value. Liveness is read from the code inductor generates: each buffer of a chunk's
logits size from its allocation (or reuse) to its `del`."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from torchtitan_glm.ops.linear_cross_entropy import linear_cross_entropy
from torchtitan_glm.ops.order_after import order_after

N, D, V, CHUNK = 2048, 64, 4096, 256


def _most_alive(code: str, numel: int) -> int:
    """The most buffers of >= numel elements alive at once in the generated call()."""
    body = code[code.index("def call("):]
    live: set[str] = set()
    most = 0
    for line in body.splitlines():
        line = line.strip()
        m = re.match(r"(buf\d+) = empty_strided_\w+\(\(([\d, ]+)\)", line)
        if m and eval("*".join(m.group(2).replace(" ", "").rstrip(",").split(","))) >= numel:
            live.add(m.group(1))
        m = re.match(r"(buf\d+) = (buf\d+);", line)  # inductor's buffer reuse: the new name takes the old one's memory
        if m and m.group(2) in live:
            live.add(m.group(1))
        for name in re.findall(r"del (buf\d+)", line):
            live.discard(name)
        most = max(most, len(live))
    return most


@pytest.mark.parametrize("need_grad", [True, False])
def test_compiled_ce_holds_one_chunk_of_logits(need_grad):
    torch.manual_seed(0)
    hidden = torch.randn(N, D, requires_grad=need_grad)
    weight = torch.randn(V, D, requires_grad=need_grad)
    labels = torch.randint(0, V, (N,))
    labels[::7] = -100
    weights = torch.rand(N)

    def loss(h, w):
        return linear_cross_entropy(h, w, labels, weights, chunk_size=CHUNK)

    torch._dynamo.reset()
    (got, got_ce), codes = run_and_get_code(torch.compile(loss, fullgraph=True, backend="inductor"), hidden, weight)
    # logits, and with gradients the softmax gradient: one chunk's (the eight chunks' were up to five at once)
    limit = 2 if need_grad else 1
    assert max(_most_alive(c, CHUNK * V) for c in codes) <= limit
    want, want_ce = loss(hidden, weight)
    torch.testing.assert_close(got_ce, want_ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    if need_grad:
        got_g = torch.autograd.grad(got, (hidden, weight))
        want_g = torch.autograd.grad(want, (hidden, weight))
        for g, w, name in zip(got_g, want_g, ("hidden", "weight")):
            # inductor sums the vocabulary in another order: 1e-5 of the gradient's scale
            scale = float(w.abs().max())
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"d{name}: {m}")


def test_order_after_copies_and_fakes():
    x = torch.randn(3, 4)
    y = order_after(x, [torch.ones(2)])
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    torch.library.opcheck(order_after, (x, [torch.ones(2)]))
