"""FP8 routed experts: token-group padding changes nothing, and the CPU emulation of torchao's FP8 rowwise grouped
GEMM rounds exactly as torchao's own torch reference quantisers do (forward, dgrad and wgrad operands)."""

import pytest
import torch
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
from torchao.prototype.moe_training.utils import torch_to_float8_per_group_colwise

from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.models.glm5.moe import GroupedExperts
from torchtitan_glm.ops.grouped_mm import grouped_mm, pad_groups

E4M3 = torch.float8_e4m3fn


def _axiswise(x: torch.Tensor, dim: int) -> torch.Tensor:
    scale = tensor_to_scale(x, E4M3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                            round_scales_to_power_of_2=True)
    return to_fp8_saturated(x.float() * scale, E4M3).double() / scale.double()


def _group_colwise(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per (group, column) over the group's rows: torchao's torch reference, group by group (it rejects empty ones)."""
    out, start = torch.empty_like(x, dtype=torch.float64), 0
    for end in offs.tolist():
        if end > start:
            data, scales = torch_to_float8_per_group_colwise(x[start:end], torch.tensor([end - start]), E4M3,
                                                             round_scales_to_power_of_2=True)
            out[start:end] = data.double() / scales.double()
        start = end
    return out


def _groups(offs):
    return list(zip([0] + offs[:-1].tolist(), offs.tolist()))


def test_pad_groups_places_rows_at_aligned_group_starts():
    counts = torch.tensor([3, 0, 17, 16, 1])
    x = torch.arange(int(counts.sum()), dtype=torch.float32).unsqueeze(-1).expand(-1, 2).contiguous()
    padded, offs, index = pad_groups(x, counts, align=16)
    assert offs.tolist() == [16, 16, 48, 64, 80] and padded.shape[0] == 112  # 37 + 5 * 15 rounded up to 16
    starts = [0, 16, 16, 48, 64]
    for g, (s, c) in enumerate(zip([0, 3, 3, 20, 36], counts.tolist())):
        assert torch.equal(padded[starts[g]:starts[g] + c], x[s:s + c])
        assert padded[starts[g] + c:offs[g]].abs().sum() == 0
    assert torch.equal(padded[index], x)


def test_emulated_fp8_grouped_mm_rounds_like_torchao():
    torch.manual_seed(0)
    offs = torch.tensor([16, 16, 48, 64], dtype=torch.int32)  # aligned groups, one empty
    x = (torch.randn(64, 32) * torch.logspace(-2, 2, 64).unsqueeze(-1)).requires_grad_()
    weight = torch.randn(4, 48, 32)  # the [G, out, in] parameter
    weight.requires_grad_()
    dy = torch.randn(64, 48)
    (grouped_mm(x, weight.transpose(-2, -1), offs, fp8=True) * dy).sum().backward()

    w_t = weight.detach().transpose(-2, -1)
    xq, wq = _axiswise(x.detach(), -1), _axiswise(w_t, -2)
    dyq, wq_d = _axiswise(dy, -1), _axiswise(w_t, -1)
    dy_c, x_c = _group_colwise(dy, offs), _group_colwise(x.detach(), offs)
    out = torch.zeros(64, 48, dtype=torch.float64)
    dx = torch.zeros(64, 32, dtype=torch.float64)
    dw = torch.zeros(4, 48, 32, dtype=torch.float64)
    for g, (s, e) in enumerate(_groups(offs)):
        out[s:e] = xq[s:e] @ wq[g]
        dx[s:e] = dyq[s:e] @ wq_d[g].t()
        dw[g] = dy_c[s:e].t() @ x_c[s:e]
    got = grouped_mm(x.detach(), w_t, offs, fp8=True)
    torch.testing.assert_close(got.double(), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), dw, rtol=1e-5, atol=1e-5)
    assert weight.grad.is_contiguous()  # formed in the parameter layout
    hp = grouped_mm(x.detach(), w_t, offs)
    rel = (got - hp).norm() / hp.norm()
    assert 1e-3 < rel < 0.1, rel  # FP8 rounding is there, and only rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_track_bf16_experts(dtype):
    args = get_flavor("debug")
    torch.manual_seed(0)
    experts = GroupedExperts(args)
    experts.init_weights()
    experts.to(dtype)
    counts = torch.tensor([5, 0, 21, 3, 1, 9, 0, 2])
    x = torch.randn(int(counts.sum()), args.hidden_size, dtype=dtype)
    hp = experts(x, counts)
    experts.fp8 = True
    lp = experts(x, counts)
    assert lp.shape == hp.shape and lp.dtype == dtype
    rel = ((lp - hp).float().norm() / hp.float().norm()).item()
    assert 1e-3 < rel < 0.1, rel
