"""The fused low-bit AdamW step (components/lowbit_step.py) on CUDA against torchao's own compiled step, for both
state formats (AdamW8bit's dynamic map, AdamWFp8's E4M3), through build_optimizer as train.py builds them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtitan_glm.components.optimizer import build_optimizer
from torchtitan_glm.config import OptimizerConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class _Params(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        # quantised (a multiple of 256 values, >= 4096), not a multiple of 256, and small: the last two keep plain
        # states; ndim 1 -> no decay
        self.w = nn.Parameter(torch.randn(1024, 4096, generator=g) * 0.02)
        self.odd = nn.Parameter(torch.randn(4100, 3, generator=g) * 0.02)
        self.b = nn.Parameter(torch.randn(96, generator=g) * 0.02)


@pytest.mark.parametrize("name,dtype", [("AdamW8bit", torch.float32), ("AdamWFp8", torch.float32),
                                        ("AdamW8bit", torch.bfloat16)])
def test_fused_step_matches_torchaos_compiled_step(name, dtype):
    """FP32 parameters (FSDP2's sharded ones) and BF16 ones (plain states then BF16; the update rounds to nearest
    even in both, which Triton's CPU interpreter does not do)."""
    runs = []
    for impl in ("fused", "compiled"):
        model = _Params().to("cuda", dtype)
        cfg = OptimizerConfig(name=name, lr=1e-3, weight_decay=0.1, implementation=impl)
        opt = build_optimizer(model=model, cfg=cfg)
        assert opt.implementation == impl
        gen = torch.Generator(device="cuda").manual_seed(1)
        for step in range(5):
            opt.param_groups[0]["lr"].fill_(1e-3 * (step + 1) / 5)
            for p in model.parameters():
                p.grad = (torch.randn(p.shape, generator=gen, device="cuda") * 1e-3).to(dtype)
            opt.step()
        runs.append((model, opt))
    (fm, fo), (cm, co) = runs
    tol = 2e-6 if dtype == torch.float32 else 8e-3  # BF16: a rounding flip is one ulp (2^-8 relative)
    for (n, a), b in zip(fm.named_parameters(), cm.parameters()):
        diff = (a - b).abs().detach()
        # within rounding, but for the few values whose moment took the neighbouring code (one E4M3 ulp moves an
        # update by up to 1/8 of its size: the updates over the five steps sum to at most ~3e-3)
        assert a.dtype == dtype and (diff > tol * b.abs().max()).float().mean() < 1e-3, (n, diff.max())
        assert diff.max() <= 5e-4, (n, diff.max())
        if dtype == torch.bfloat16:
            assert (a != b).float().mean() < 1e-3, n
        sa, sb = fo.state[a], co.state[b]
        for k in ("exp_avg", "exp_avg_sq"):
            x, y = sa[k], sb[k]
            if n == "w":
                assert type(x) is type(y) and type(x).__name__ in ("OptimState8bit", "OptimStateFp8")
                codes_x, codes_y = x.codes.view(torch.uint8).int(), y.codes.view(torch.uint8).int()
                diff = (codes_x - codes_y).abs()
                # one code (or one E4M3 ulp) apart where FP32 rounding order puts a value across a midpoint
                assert (diff > 0).float().mean() < 1e-3, (name, k, (diff > 0).sum())
                if name == "AdamW8bit":
                    assert diff.max() <= 1
                else:  # adjacent E4M3 values of one sign have adjacent bit patterns
                    assert diff[diff > 0].max() <= 1 if (diff > 0).any() else True
                assert torch.allclose(x.scale, y.scale, rtol=2e-6, atol=0), (name, k)
            else:
                assert type(x) is torch.Tensor and (x - y).abs().max() <= tol * y.abs().max(), (n, k)


def test_found_inf_on_the_device_skips_the_step():
    """The trainer's device-side skip: found_inf = 1 leaves parameters, codes, scales and step counts unchanged
    (nothing read by the host: the flag and the counts stay on the GPU)."""
    from torchtitan_glm.components.step_stats import optimizer_step, supports_device_skip

    model = _Params().cuda()
    opt = build_optimizer(model=model, cfg=OptimizerConfig(name="AdamW8bit", lr=1e-3, implementation="fused"))
    assert supports_device_skip(opt, device=torch.device("cuda"))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer_step(opt, found_inf=torch.zeros((), device="cuda"))
    snap = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = {n: [t.clone() for t in _tensors(opt.state[p])] for n, p in model.named_parameters()}
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer_step(opt, found_inf=torch.ones((), device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), snap[n]), n
        assert all(map(torch.equal, _tensors(opt.state[p]), states[n])), n
        assert opt.state[p]["step"].device.type == "cuda" and float(opt.state[p]["step"]) == 1.0


def _tensors(state: dict) -> list[torch.Tensor]:
    out = [state["step"]]
    for k in ("exp_avg", "exp_avg_sq"):
        s = state[k]
        out += [s.codes, s.scale] if hasattr(s, "codes") else [s]
    return out


def test_8bit_codes_found_each_way_equal_the_reference_on_cuda():
    """The codes found each way, with the GPU's approximate log2/exp2, against the reference's rule
    (tests/lowbit_codes.py)."""
    from tests.lowbit_codes import mismatches

    result = mismatches("cuda")
    assert not any(v for k, v in result.items() if "!=" in k), result
