"""The fused step of torchao's AdamW8bit / AdamWFp8 (`optimizer.implementation = "fused"`): the same states, created
by torchao, updated by ops/adamw_lowbit.py (one Triton kernel per parameter on CUDA, its torch reference elsewhere)
instead of torchao's torch.compile'd per-parameter function, without reading the device (see fused_lowbit_step)."""

from __future__ import annotations

import struct

import torch
from torch import Tensor


def _f32(x: float) -> float:
    """x rounded to FP32 (the product of two FP32 values is exact in a double, so rounding it once gives FP32's)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _local(t: Tensor) -> Tensor:
    """This rank's plain tensor of a parameter, gradient or state: a DTensor's local shard, unwrapped from
    torchao's FP8 all-gather wrapper (float8.fsdp_float8_all_gather), which a Triton kernel cannot take."""
    from torchtitan_glm.components.logs import local_shard

    return local_shard(t)


def state_format(state: Tensor) -> int:
    """The fused kernel's format code (ops/adamw_lowbit.py) of one torchao optimizer moment."""
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    from torchtitan_glm.ops.adamw_lowbit import DYNAMIC8, FP8, PLAIN

    if isinstance(state, OptimState8bit):
        return DYNAMIC8
    if isinstance(state, OptimStateFp8):
        return FP8
    return PLAIN


@torch.no_grad()
def fused_lowbit_step(optimizer: torch.optim.Optimizer, found_inf: Tensor | None = None) -> None:
    """One step of a torchao `_AdamBase` AdamW optimizer (AdamW8bit or AdamWFp8) through ops/adamw_lowbit.py.

    The step counts live on the parameters' device (a count torchao's compiled step left on the host moves there
    once): they advance by 1 - found_inf there, and the kernel forms the bias corrections from them, so neither
    the count nor the flag is read by the host. The learning rate is torchao's host-side tensor."""
    from torchtitan_glm.ops.adamw_lowbit import adamw_lowbit_step_

    if not optimizer.is_adamw or optimizer.bf16_stochastic_round:
        raise ValueError("the fused low-bit step implements AdamW without BF16 stochastic rounding only")
    for group in optimizer.param_groups:
        if group["amsgrad"]:
            raise ValueError("the fused low-bit step does not implement amsgrad")
        lr = group["lr"]
        if not isinstance(lr, Tensor):
            raise RuntimeError("lr was changed to a non-Tensor object; update it with param_groups[i]['lr'].fill_()")
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        steps = []
        for p in params:
            state = optimizer.state[p]
            device = _local(p).device
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = optimizer._new_buffer(p, True)
                state["exp_avg_sq"] = optimizer._new_buffer(p, False)
            elif state["step"].device != device:
                state["step"] = state["step"].to(device=device, dtype=torch.float32)
            steps.append(state["step"])
        flag = None if found_inf is None else found_inf.to(device=steps[0].device, dtype=torch.float32)
        if flag is None:
            torch._foreach_add_(steps, 1.0)
        else:  # a tensor list, not a 0-dim tensor operand (which the CPU path reads as a scalar)
            torch._foreach_add_(steps, [1.0 - flag] * len(steps))
        beta1, beta2 = group["betas"]
        lr_value = lr.item()  # a host tensor, as torchao keeps it
        lr_wd = _f32(_f32(lr_value) * _f32(group["weight_decay"]))  # torchao's FP32 lr * weight_decay
        for p in params:
            state = optimizer.state[p]
            exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            adamw_lowbit_step_(_local(p.detach()), _local(p.grad), exp_avg, exp_avg_sq, state["step"],
                               fmt=state_format(exp_avg), lr=lr_value, lr_wd=lr_wd, beta1=beta1, beta2=beta2,
                               eps=group["eps"], found_inf=flag)
