"""The MoE combine (models/glm5/moe.py::MoE._routed): each token's k weighted expert rows summed in FP32 with one
rounding, in (token, slot) order, without atomics: the BF16 result is within half a BF16 ulp (plus the products'
own rounding) of the exact sum, where adding the rows one by one in BF16, as a CUDA index_add's atomics do, is not
(the CPU's index_add happens to round once too, so the old form cannot be told apart here: the sequential sum
stands in for it); the same for the input's gradient; and the compiled graphs have no accumulating scatter. On CUDA:
tests/gpu/test_moe_combine_cuda.py."""

from __future__ import annotations

import torch

from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.models.glm5.moe import MoE


def _moe(dtype: torch.dtype) -> MoE:
    torch.manual_seed(0)
    moe = MoE(get_flavor("debug").replace(n_routed_experts=8, num_experts_per_tok=4, n_group=1, topk_group=1))
    moe.init_weights()
    return moe.to(dtype)


def _fake_experts(x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """An expert output that depends on the row and its expert, known exactly: x * (1 + expert / 7)."""
    expert = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                     output_size=x_sorted.shape[0])
    return x_sorted * (1 + expert / 7).to(x_sorted.dtype).unsqueeze(-1)


def _bf16_case(seed: int) -> tuple[MoE, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    """A BF16 MoE with the fake experts, 96 tokens, and their routing (ids, weights)."""
    moe = _moe(torch.bfloat16)
    moe.experts.forward = _fake_experts
    gen = torch.Generator().manual_seed(seed)
    flat = (torch.randn(96, moe.gate.weight.shape[1], generator=gen) * 3).bfloat16()
    _, idx, weights = moe.gate(flat)
    return moe, flat, idx, weights, gen


def _half_ulp(exact: torch.Tensor) -> torch.Tensor:
    """Half a BF16 ulp at each element of `exact` (FP64): the error of one rounding."""
    return 0.5 * torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)


def test_bf16_combine_rounds_once():
    moe, flat, idx, weights, _ = _bf16_case(1)
    out, counts = moe._routed(flat, idx, weights)
    assert counts.sum() == idx.numel()
    # the k products, each rounded to BF16 as the module forms them, then their exact sum
    y = flat.unsqueeze(1) * (1 + idx / 7).to(torch.bfloat16).unsqueeze(-1)
    products = y * weights.unsqueeze(-1).to(torch.bfloat16)
    exact = products.double().sum(1)
    assert ((out.double() - exact).abs() <= _half_ulp(exact)).all()  # one rounding of an FP32 sum
    sequential = torch.zeros_like(flat)  # the rows added one at a time in BF16 (CUDA atomics' rounding)
    for slot in range(idx.shape[1]):
        sequential = sequential + products[:, slot]
    assert ((sequential.double() - exact).abs() > _half_ulp(exact)).any()  # the check can fail


def test_bf16_dispatch_backward_rounds_once():
    """d(flat): each token's k row gradients summed in FP32 with one rounding (models/glm5/moe.py::_Dispatch)."""
    moe, flat, idx, weights, gen = _bf16_case(2)
    flat.requires_grad_()
    grad_out = torch.randn(flat.shape, generator=gen).bfloat16()
    moe._routed(flat, idx, weights)[0].backward(grad_out)
    # per slot, in BF16 as autograd forms it: grad_out x weight, then x the fake expert's factor
    per_slot = grad_out.unsqueeze(1) * weights.unsqueeze(-1).to(torch.bfloat16)
    per_slot = per_slot * (1 + idx / 7).to(torch.bfloat16).unsqueeze(-1)
    exact = per_slot.double().sum(1)
    assert ((flat.grad.double() - exact).abs() <= _half_ulp(exact)).all()


def test_fp32_combine_is_the_weighted_sum_and_its_gradients():
    moe = _moe(torch.float64)
    moe.experts.forward = _fake_experts
    flat = torch.randn(40, moe.gate.weight.shape[1], dtype=torch.float64, requires_grad=True)
    _, idx, weights = moe.gate(flat)
    weights = weights.detach().double().requires_grad_()
    torch.autograd.gradcheck(lambda x, w: moe._routed(x, idx, w)[0], (flat, weights))
    expected = (flat.unsqueeze(1) * (1 + idx / 7).unsqueeze(-1) * weights.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(moe._routed(flat, idx, weights)[0], expected, rtol=1e-12, atol=1e-12)


def test_compiled_combine_has_no_accumulating_scatter():
    """Neither the forward graph (the combine) nor the backward graph (the dispatch's gradient) has an index_add /
    index_put: no atomics in the MoE output or in its input's gradient."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs: dict[str, list[str]] = {"forward": [], "backward": []}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name].extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return make_boxed_func(gm.forward)
        return compiler

    moe = _moe(torch.float32)
    flat = torch.randn(32, moe.gate.weight.shape[1], requires_grad=True)
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    out, _ = torch.compile(moe, backend=backend, fullgraph=True)(flat)
    out.sum().backward()
    assert flat.grad is not None
    for name, targets in graphs.items():
        assert "aten.index_copy.default" in targets, (name, sorted(set(targets)))
        assert not any("index_add" in t or "index_put" in t for t in targets), (name, sorted(set(targets)))
