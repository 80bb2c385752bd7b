"""The grouped-GEMM custom op equals a per-expert loop, forward and backward, including empty groups; weight
gradients arrive in the parameter's own layout."""

import pytest
import torch

from torchtitan_glm.ops.grouped_mm import grouped_mm


@pytest.mark.parametrize("k,m", [(8, 6), (16, 8)])  # unaligned -> loop path; 16-byte aligned fp32 -> native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_mm_matches_loop(dtype, k, m):
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5, 1])
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), k, dtype=dtype, requires_grad=True)
    w = torch.randn(4, k, m, dtype=dtype, requires_grad=True)
    dy = torch.randn(x.shape[0], m, dtype=dtype)
    (grouped_mm(x, w, offs) * dy).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([x2[s:e] @ w2[g] for g, (s, e) in enumerate(zip([0] + offs[:-1].tolist(), offs.tolist()))])
    (ref * dy).sum().backward()
    torch.testing.assert_close(grouped_mm(x, w, offs), ref)
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    assert w.grad[1].abs().max() == 0  # the empty group gets no gradient


@pytest.mark.parametrize("backend", [None, "aot_eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_weight_grad_arrives_in_parameter_layout(dtype, backend):
    """The MoE passes param.transpose(-2, -1): the weight gradient must reach the parameter contiguous (eager and
    compiled), with the same values as a per-expert loop."""
    torch.manual_seed(0)
    counts = torch.tensor([4, 0, 12, 16])
    offs = counts.cumsum(0).to(torch.int32)
    param = torch.randn(4, 16, 32, dtype=dtype, requires_grad=True)  # [G, M, K]
    x = torch.randn(int(counts.sum()), 32, dtype=dtype)
    dy = torch.randn(x.shape[0], 16, dtype=dtype)
    seen = []
    param.register_hook(lambda g: seen.append((g.is_contiguous(), g.stride())))

    def f(x, param, offs, dy):
        return (grouped_mm(x, param.transpose(-2, -1), offs) * dy).sum()

    if backend is not None:
        f = torch.compile(f, backend=backend, fullgraph=True)
    f(x, param, offs, dy).backward()
    assert seen == [(True, param.stride())]
    ref = torch.stack([dy[s:e].float().t() @ x[s:e].float()
                       for s, e in zip([0] + offs[:-1].tolist(), offs.tolist())])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(param.grad.float(), ref, **tol)


def test_grouped_mm_opcheck():
    x, w = torch.randn(6, 16), torch.randn(3, 16, 8)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    torch.library.opcheck(torch.ops.torchtitan_glm.grouped_mm.default, (x, w, offs))
