"""The fused step of torchao's AdamW8bit / AdamWFp8 (`optimizer.implementation = "fused"`): the same states, created
by torchao, updated by ops/adamw_lowbit.py (one Triton kernel per parameter on CUDA, its torch reference elsewhere)
instead of torchao's torch.compile'd per-parameter function. Scalars are computed on the host from torchao's host-side step counter and
learning-rate tensor, as torchao computes them, so the step never reads the device."""

from __future__ import annotations

import torch
from torch import Tensor


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _format(state: Tensor) -> int:
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    from torchtitan_glm.ops.adamw_lowbit import DYNAMIC8, FP8, PLAIN

    if isinstance(state, OptimState8bit):
        return DYNAMIC8
    if isinstance(state, OptimStateFp8):
        return FP8
    return PLAIN


@torch.no_grad()
def fused_lowbit_step(optimizer: torch.optim.Optimizer) -> None:
    """One step of a torchao `_AdamBase` AdamW optimizer (AdamW8bit or AdamWFp8) through the fused kernel."""
    from torchtitan_glm.ops.adamw_lowbit import adamw_lowbit_step_

    if not optimizer.is_adamw or optimizer.bf16_stochastic_round:
        raise ValueError("the fused low-bit step implements AdamW without BF16 stochastic rounding only")
    for group in optimizer.param_groups:
        if group["amsgrad"]:
            raise ValueError("the fused low-bit step does not implement amsgrad")
        lr = group["lr"]
        if not isinstance(lr, Tensor):
            raise RuntimeError("lr was changed to a non-Tensor object; update it with param_groups[i]['lr'].fill_()")
        beta1, beta2 = group["betas"]
        scalars: dict[float, dict[str, float]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = optimizer._new_buffer(p, True)
                state["exp_avg_sq"] = optimizer._new_buffer(p, False)
            state["step"] += 1
            step = state["step"]
            key = float(step)
            if key not in scalars:  # host FP32 tensors, as torchao's step computes them
                scalars[key] = dict(lr=lr.item(), lr_wd=(lr * group["weight_decay"]).item(),
                                    bc1=(1 - beta1 ** step).item(), bc2_sqrt=(1 - beta2 ** step).sqrt().item())
            exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            adamw_lowbit_step_(_local(p.detach()), _local(p.grad), exp_avg, exp_avg_sq, fmt=_format(exp_avg),
                               beta1=beta1, beta2=beta2, eps=group["eps"], **scalars[key])
