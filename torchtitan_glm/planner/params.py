"""Bytes of parameters, gradients and optimizer state one rank holds, as the trainer holds them.

FSDP2 (`fully_shard`, Shard(0)): each parameter's dim 0 is cut into chunks of ceil(d0 / W) rows; every rank allocates
one padded chunk for the parameter and for the gradient (the gradient is a view into the unit's flat reduce-scatter
output), and AdamW allocates exp_avg and exp_avg_sq of the unpadded local shard plus a 4-byte `step` per parameter.
Parameters and gradients stay in the dtype the model was built in (FP32 master weights and gradients; BF16 is only
the compute copy FSDP2 all-gathers). FP32-kept parameters (parallelize.py) are whole on every rank, FP32, and so are
their gradients and optimizer states. Only trainable parameters have gradients and optimizer states.

Tensor parallelism (parallelize.py) first splits the parameters its plan names over tp (tensor_parallel_dims), and
FSDP2 then chunks each rank's tp-local tensor on dim 0 over dp_shard x cp. Under expert parallelism the routed
experts are split over ep (E/ep whole experts per rank) and kept out of FSDP2: whole, in the model's dtype, on every
rank of the expert-data group, like the FP32-kept parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_glm.components.optimizer import adamw_state_bytes

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


def outside(p: Param, layout: Layout) -> bool:
    """Kept whole, gradients all-reduced after the backward: FP32-kept parameters, and routed experts under expert
    parallelism without expert_fsdp."""
    return p.replicated or (p.expert and layout.ep > 1 and not layout.experts_sharded)


def fsdp_world(p: Param, layout: Layout) -> int:
    """The shard degree of `p`: dp_shard x cp (FSDP2), or for routed experts under EP with expert_fsdp every rank
    holding the same experts (their op's gather / reduce-scatter)."""
    return layout.expert_shards if (p.expert and layout.ep > 1) else layout.fsdp


def shard_of(p: Param, layout: Layout, *, rank: int = 0) -> Shard:
    """`p` on FSDP rank `rank` (its coordinate in the FSDP mesh) of `layout`."""
    shape = list(p.shape)
    if p.tp_dim is not None and layout.tp > 1:
        shape[p.tp_dim] = _ceil(shape[p.tp_dim], layout.tp)
    if p.expert and layout.ep > 1:
        shape[0] //= layout.ep
    rest = 1
    for s in shape[1:]:
        rest *= s
    if outside(p, layout):
        return Shard(shape[0] * rest, shape[0] * rest)
    world = fsdp_world(p, layout)
    if p.expert and shape[0] < world and len(shape) > 1:  # fewer local experts than shard ranks: dim 1
        rest = rest // shape[1] * shape[0]
        shape = [shape[1], shape[0], *shape[2:]]
    chunk = _ceil(shape[0], world)
    rows = max(0, min(chunk, shape[0] - rank * chunk))
    return Shard(chunk * rest, rows * rest)


@dataclass(frozen=True)
class StateBytes:
    """Per rank: parameters (FSDP shards + replicated), gradients, optimizer state; `replicated_*` is the part kept
    out of FSDP2 (the FP32-kept parameters; the routed experts under expert parallelism)."""

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
    """What one rank of the trainer holds after an optimizer step (AdamW: two states in the parameters' dtype; the
    low-bit AdamWs: 1 byte a value plus block scales, as components/optimizer.py counts them)."""
    params = grads = opt = rp = rg = ro = tensors = 0
    for p in inv.params:
        s = shard_of(p, layout, rank=rank)
        pb = s.padded * p.dtype_bytes
        params += pb
        kept_out = outside(p, layout)
        if kept_out:
            rp += pb
        if not p.trainable:
            continue
        tensors += 1
        g = pb
        o = adamw_state_bytes(s.local, p.dtype_bytes, inv.optimizer) + STEP_BYTES
        grads += g
        opt += o
        if kept_out:
            rg += g
            ro += o
    return StateBytes(params, grads, opt, rp, rg, ro, tensors)


def unit_bytes(unit: Unit, layout: Layout, *, dtype_bytes: int, sharded: bool) -> int:
    """Bytes of a unit's FSDP-managed parameters at `dtype_bytes` per element: the padded local shard, or the whole
    tp-local tensor a rank holds while the unit runs (FSDP2's all-gather)."""
    total = 0
    for p in unit.params:
        if outside(p, layout):
            continue
        s = shard_of(p, layout)
        total += (s.padded if sharded else s.padded * fsdp_world(p, layout)) * dtype_bytes
    return total


def trainable_unit_bytes(unit: Unit, layout: Layout, *, dtype_bytes: int) -> int:
    """Unsharded bytes of a unit's trainable FSDP-managed parameters (its gradients before the reduce-scatter)."""
    total = 0
    for p in unit.params:
        if p.trainable and not outside(p, layout):
            total += shard_of(p, layout).padded * fsdp_world(p, layout) * dtype_bytes
    return total


def outside_unit_bytes(unit: Unit, layout: Layout, *, trainable_only: bool = False) -> int:
    """Bytes of a unit's parameters kept out of FSDP2 (FP32-kept; experts under EP), as held: the rank's part."""
    return sum(shard_of(p, layout).padded * p.dtype_bytes for p in (*unit.params, *unit.replicated)
               if outside(p, layout) and (p.trainable or not trainable_only))


def local_trainable_elements(inv: ModelInventory, layout: Layout, *, rank: int = 0) -> int:
    """Trainable parameter elements one rank updates (its local shards and the replicated parameters)."""
    return sum(shard_of(p, layout, rank=rank).local for p in inv.params if p.trainable)
