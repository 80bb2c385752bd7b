"""Differentiable collectives shared by the parallel code (torch's functional collectives, picked by version)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

# torch 2.13 renamed all_gather_tensor_autograd (2.11) to all_gather_single_autograd and deprecated the old name.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward hands on a contiguous gradient. torch 2.11's all-gather backward reduce-scatters
    the incoming gradient as it comes and fails on a strided one ("Expected input.is_contiguous()"), as when the
    gathered tensor is transposed and reshaped (ops/kda_cp.py conv_halo); torch 2.13 copies it itself."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def all_gather_autograd(x: Tensor, *, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Concatenate every rank's x along dim, in rank order; the gradient of x is the sum over ranks of the
    gradient of its slot (traceable by dynamo)."""
    dim = dim % x.ndim
    out = _all_gather(x.contiguous(), 0, group)  # may be an AsyncCollectiveTensor: its first use waits
    out = _ContiguousGrad.apply(out)
    if dim == 0:
        return out
    world = dist.get_world_size(group)
    return torch.cat(out.chunk(world, dim=0), dim=dim)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (a replicated input feeding rank-local heads)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None


def sum_grad_over(x: Tensor, *, group: dist.ProcessGroup) -> Tensor:
    """x unchanged; its gradient becomes the sum over the group's ranks (each rank computes with its own heads)."""
    return _SumGradOverGroup.apply(x, group)
