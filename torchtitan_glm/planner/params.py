"""Bytes of parameters, gradients and optimizer state one rank holds, as the trainer holds them.

FSDP2 (`fully_shard`, Shard(0)): each parameter's dim 0 is cut into chunks of ceil(d0 / W) rows; every rank allocates
one padded chunk for the parameter and for the gradient (the gradient is a view into the unit's flat reduce-scatter
output), and AdamW allocates exp_avg and exp_avg_sq of the unpadded local shard plus a 4-byte `step` per parameter.
Parameters and gradients stay in the dtype the model was built in (FP32 master weights and gradients; BF16 is only
the compute copy FSDP2 all-gathers). FP32-kept parameters (parallelize.py) are whole on every rank, FP32, and so are
their gradients and optimizer states. Only trainable parameters have gradients and optimizer states.

Layouts of issue 10 (planned, not yet in the trainer): tensor parallelism divides the parameters its plan splits by
tp before FSDP2; routed experts are divided over ep ranks and FSDP2-sharded over dp_shard x cp / ep (on dim 1 when
there are fewer local experts than shard ranks, as TorchTitan does); everything else is sharded over dp_shard x cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Layout
from .model import ModelInventory, Param, Unit

STEP_BYTES = 4  # AdamW's per-parameter `step` scalar (float32)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Shard:
    """One parameter on one rank: elements allocated (padded chunk) and held by the local shard (unpadded)."""

    padded: int
    local: int


def shard_of(p: Param, layout: Layout, *, rank: int = 0) -> Shard:
    """`p` on FSDP rank `rank` (its coordinate in the parameter's FSDP mesh) of `layout`."""
    shape = list(p.shape)
    if p.tp_split and layout.tp > 1:
        shape[0] = _ceil(shape[0], layout.tp)
    if p.replicated:
        n = 1
        for s in shape:
            n *= s
        return Shard(n, n)
    world = layout.fsdp
    if p.expert and layout.ep > 1:
        shape[0] //= layout.ep
        world = layout.edp
        if shape[0] < world and len(shape) > 1:  # fewer local experts than shard ranks: shard dim 1 instead
            shape = [shape[1], shape[0], *shape[2:]]
    rest = 1
    for s in shape[1:]:
        rest *= s
    chunk = _ceil(shape[0], world)
    rows = max(0, min(chunk, shape[0] - rank * chunk))
    return Shard(chunk * rest, rows * rest)


@dataclass(frozen=True)
class StateBytes:
    """Per rank: parameters (FSDP shards + replicated), gradients, optimizer state; `replicated_*` is the FP32-kept
    part of each (kept whole on every rank)."""

    params: int
    grads: int
    optimizer: int
    replicated_params: int
    replicated_grads: int
    replicated_optimizer: int
    trainable_tensors: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(inv: ModelInventory, layout: Layout, *, rank: int = 0) -> StateBytes:
    """What one rank of the trainer holds after an optimizer step (AdamW, two states in the parameters' dtype)."""
    params = grads = opt = rp = rg = ro = tensors = 0
    for p in inv.params:
        s = shard_of(p, layout, rank=rank)
        pb = s.padded * p.dtype_bytes if not p.replicated else s.local * p.dtype_bytes
        params += pb
        if p.replicated:
            rp += pb
        if not p.trainable:
            continue
        tensors += 1
        g = pb
        o = 2 * s.local * p.dtype_bytes + STEP_BYTES
        grads += g
        opt += o
        if p.replicated:
            rg += g
            ro += o
    return StateBytes(params, grads, opt, rp, rg, ro, tensors)


def unit_bytes(unit: Unit, layout: Layout, *, dtype_bytes: int, sharded: bool) -> int:
    """Bytes of a unit's FSDP-managed parameters at `dtype_bytes` per element: the padded local shard, or the whole
    unsharded (all-gathered) tensor a rank holds during the unit's compute (TP/EP-local, FSDP-gathered)."""
    total = 0
    for p in unit.params:
        s = shard_of(p, layout)
        world = layout.edp if (p.expert and layout.ep > 1) else layout.fsdp
        total += (s.padded if sharded else s.padded * world) * dtype_bytes
    return total


def trainable_unit_bytes(unit: Unit, layout: Layout, *, dtype_bytes: int) -> int:
    """Unsharded bytes of a unit's trainable FSDP-managed parameters (its gradients before the reduce-scatter)."""
    total = 0
    for p in unit.params:
        if p.trainable:
            s = shard_of(p, layout)
            world = layout.edp if (p.expert and layout.ep > 1) else layout.fsdp
            total += s.padded * world * dtype_bytes
    return total


def local_trainable_elements(inv: ModelInventory, layout: Layout, *, rank: int = 0) -> int:
    """Trainable parameter elements one rank updates (its local shards and the replicated parameters)."""
    return sum(shard_of(p, layout, rank=rank).local for p in inv.params if p.trainable)
