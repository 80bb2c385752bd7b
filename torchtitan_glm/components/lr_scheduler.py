"""Learning-rate schedule: linear warmup from ~0, then cosine, linear or WSD decay down to a floor.

Step s (0-based; LambdaLR's counter, the optimizer step being taken) gets lr = optimizer.lr * lr_factor(s):
  warmup   s < W:            (s + 1) / (W + 1)           (never exactly 0, so the first step moves the weights)
  decay    s in [D0, T):     p = (s - D0 + 1) / (T - D0), the last step (s = T - 1) lands exactly on the floor
           cosine/linear: D0 = W;  wsd: factor 1 on [W, T - Dn), D0 = T - Dn with Dn = round(decay_ratio * T)
           cosine: f + (1 - f) * (1 + cos(pi p)) / 2;  linear and wsd: f + (1 - f) * (1 - p)
  after T:                   the floor f = min_lr_factor.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_glm.config import LRSchedulerConfig

__all__ = ["lr_factor", "WarmupDecayLR", "build_lr_scheduler"]


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay_type: str, decay_ratio: float,
              min_lr_factor: float) -> float:
    """The multiplier of the peak lr at 0-based `step` (see the module docstring)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step >= total_steps:
        return min_lr_factor
    if decay_type == "wsd":
        decay_start = max(warmup_steps, total_steps - max(1, round(decay_ratio * total_steps)))
        if step < decay_start:
            return 1.0
    elif decay_type in ("cosine", "linear"):
        decay_start = warmup_steps
    else:
        raise ValueError(f"unknown lr_scheduler.decay_type {decay_type!r}")
    progress = (step - decay_start + 1) / (total_steps - decay_start)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay_type == "cosine" else 1.0 - progress
    return min_lr_factor + (1.0 - min_lr_factor) * shape


class WarmupDecayLR(LambdaLR):
    """LambdaLR whose load_state_dict keeps this run's peak lr (optimizer.lr: lowering it after a loss spike is what
    a resume is for, and an unchanged one resumes exactly) and sets each group's lr for the restored step. The
    checkpoint loads the optimizer before the scheduler, so that lr is what the first resumed step uses. A tensor
    lr (torchao's low-bit optimizers keep one, and refuse a float) is filled in place."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_lambda) -> None:
        super().__init__(optimizer, lr_lambda=lr_lambda)
        # peak lrs as floats (a tensor lr's initial_lr is a tensor), read once here rather than in every step
        self.base_lrs = [float(b) for b in self.base_lrs]

    def load_state_dict(self, state_dict: dict) -> None:
        peaks = list(self.base_lrs)
        super().load_state_dict(state_dict)
        self.base_lrs = peaks
        for group, base, fn in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            group["initial_lr"] = base
            lr = base * fn(self.last_epoch)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def current_lr(self) -> float:
        """The first group's lr for the current step as a Python float, from the schedule rather than from the
        optimizer (whose lr may be a tensor: reading one is a host read the trainer's step avoids)."""
        return self.base_lrs[0] * self.lr_lambdas[0](self.last_epoch)


def build_lr_scheduler(*, optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig,
                       total_steps: int) -> WarmupDecayLR:
    """A LambdaLR over `lr_factor`; call .step() after each optimizer step. Its state_dict (last_epoch) is all a
    checkpoint needs: the schedule itself is rebuilt from the config."""
    fn = functools.partial(lr_factor, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                           decay_type=cfg.decay_type, decay_ratio=cfg.decay_ratio, min_lr_factor=cfg.min_lr_factor)
    return WarmupDecayLR(optimizer, lr_lambda=fn)
