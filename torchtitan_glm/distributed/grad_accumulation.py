"""Gradient accumulation (training.global_batch_size): what FSDP2 and the replicated parameters do between a step's
microbatches.

- The replicated parameters (distributed/replicated.py) keep their gradients whole on every rank anyway: they
  accumulate locally and are all-reduced once, after the last microbatch.
- FSDP2 reduce-scatters after every microbatch where its parameters are split over ranks (TorchTitan's choice: an
  unsharded gradient held between microbatches would cost the whole model's gradient per rank). Where no parameter
  is split (one rank: there the reduce is a copy and a cast; or replicas only: an all-reduce) an unsharded gradient
  is the whole gradient anyway, so nothing is saved by reducing early: the gradients accumulate unsharded in the
  reduce dtype (FSDP2's own no-sync path) and are reduced once. Not with optimizer.cpu_offload: its gradients belong
  in host memory.
- Under parallelism.fsdp_reshard_after_forward = "never" the gathered parameters stay until the step's last
  backward: one gather per optimizer step instead of one per microbatch (the memory is the same as within one
  microbatch, where every unit is held gathered from its forward to its backward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchtitan_glm.distributed.replicated import Replicated

__all__ = ["GradientAccumulation", "parameters_split"]


def parameters_split(model: nn.Module) -> bool:
    """Whether any DTensor parameter is sharded over more than one rank (FSDP2's shard dim, or tensor parallel)."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            if any(pl.is_shard() and mesh.size(dim) > 1 for dim, pl in enumerate(p.placements)):
                return True
    return False


@dataclass(frozen=True)
class GradientAccumulation:
    """`steps` microbatches per optimizer step; `defer_fsdp_reduce`: FSDP2 reduces once per step (see the module
    docstring); `hold_gathered`: FSDP2's gathered parameters stay from the first forward to the last backward."""

    steps: int
    defer_fsdp_reduce: bool = False
    hold_gathered: bool = False

    @classmethod
    def build(cls, *, model: nn.Module, steps: int, cpu_offload: bool, fsdp_reshard: str) -> "GradientAccumulation":
        if steps == 1 or not isinstance(model, FSDPModule):
            return cls(steps)
        return cls(steps, defer_fsdp_reduce=not cpu_offload and not parameters_split(model),
                   hold_gathered=fsdp_reshard == "never")

    @contextlib.contextmanager
    def microbatch(self, model: nn.Module, replicated: Replicated, *, last: bool) -> Iterator[None]:
        """Forward and backward of one microbatch inside: gradients are synchronised only after the `last` one."""
        if self.steps == 1:
            yield
            return
        if self.defer_fsdp_reduce:
            model.set_requires_gradient_sync(last)
        if self.hold_gathered:
            model.set_reshard_after_backward(last)
        with replicated.no_sync(not last):
            yield
