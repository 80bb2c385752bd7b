"""Parameters kept out of FSDP2 (FP32-kept maps and gates, expert-parallel experts): their copies agree over a
process group, and their gradients are averaged over it.

The averaging overlaps with backward: the gradients are bucketed by decoder block (in backward order, up to
`bucket_bytes` a bucket), each parameter's post-accumulate-grad hook counts it in, and a complete bucket launches
its asynchronous all-reduce at once (the NCCL stream waits for the compute stream; the host does not wait).
`Replicated.allreduce_grads()` runs after backward and before clipping: it launches the buckets whose parameters
got no gradient hook this step (with the gradients there are), waits for every bucket (on the GPU the compute stream
waits, not the host), scales and copies the results back into the gradients. Hand-written (as DDP's reducer is)
because DDP cannot wrap parameters that FSDP2 manages in the same module and that torch.compile traces per block.

The average uses ReduceOp.AVG where the backend has it (NCCL; gloo only in recent torch: probed once per group at
set-up, a one-element collective checked for the mean), else SUM and a multiply. A group whose scale is not 1/size
(the experts: their ep group's tokens were already summed by the all-to-all backward) sums and multiplies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ReplicaGroup", "Replicated", "allreduce_replicated_grads", "broadcast_replicated_params",
           "avg_supported", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class ReplicaGroup:
    """Parameters outside FSDP2 whose copies must agree over `group`; gradients are summed over it and scaled."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    grad_scale: float
    broadcast_group: dist.ProcessGroup | None = None  # where the values are made equal (default: `group`)


@dataclass
class _Bucket:
    """Consecutive gradients of one group, reduced together as one flat FP32 tensor."""

    params: list[nn.Parameter]
    group: dist.ProcessGroup | None
    scale: float
    avg: bool  # ReduceOp.AVG does the whole scaling
    ready: int = 0  # parameters whose gradient was accumulated since the last allreduce_grads
    work: Any = None
    flat: torch.Tensor | None = None
    grads: list[torch.Tensor] = field(default_factory=list)

    def launch(self) -> None:
        self.grads = [_local(p.grad) for p in self.params if p.grad is not None]
        if not self.grads:
            return
        self.flat = torch.cat([g.reshape(-1).float() for g in self.grads])
        op = dist.ReduceOp.AVG if self.avg else dist.ReduceOp.SUM
        self.work = dist.all_reduce(self.flat, op=op, group=self.group, async_op=True)

    def finish(self) -> None:
        if self.work is None:
            self.launch()
        if self.work is not None:
            self.work.wait()
            if not self.avg:
                self.flat.mul_(self.scale)
            sizes = [g.numel() for g in self.grads]
            torch._foreach_copy_(self.grads, [v.view_as(g) for v, g in zip(self.flat.split(sizes), self.grads)])
        self.ready, self.work, self.flat, self.grads = 0, None, None, []


@dataclass
class Replicated:
    """Every parameter kept out of FSDP2, by the group its copies live on."""

    groups: list[ReplicaGroup] = field(default_factory=list)
    buckets: list[_Bucket] = field(default_factory=list)
    sync: bool = True  # False inside no_sync(): gradients accumulate, no bucket launches

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for g in self.groups for p in g.params]

    def __iter__(self):
        return iter(self.params)

    def overlap_with_backward(self, *, order: Iterable[nn.Module], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        """Bucket the trainable gradients of every group reduced over more than one rank, in the order of
        `order`'s modules (backward order: the last block first; parameters of no listed module come last), and
        register the hooks that launch each bucket once its gradients are in."""
        if not dist.is_initialized():
            return
        rank_of: dict[int, int] = {}
        for i, module in enumerate(order):
            for p in module.parameters():
                rank_of.setdefault(id(p), i)
        for g in self.groups:
            size = dist.get_world_size(g.group)
            params = [p for p in g.params if p.requires_grad]
            if size == 1 or not params:
                continue
            avg = abs(g.grad_scale * size - 1.0) < 1e-12 and avg_supported(g.group)
            params.sort(key=lambda p: rank_of.get(id(p), len(rank_of)))
            current: list[nn.Parameter] = []
            nbytes = 0
            for p in params:
                current.append(p)
                nbytes += _local(p).numel() * 4
                if nbytes >= bucket_bytes:
                    self.buckets.append(_Bucket(current, g.group, g.grad_scale, avg))
                    current, nbytes = [], 0
            if current:
                self.buckets.append(_Bucket(current, g.group, g.grad_scale, avg))
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._hook(bucket))

    @contextlib.contextmanager
    def no_sync(self, enabled: bool = True) -> Iterator[None]:
        """Inside (when `enabled`), backward accumulates the replicated gradients without launching their
        all-reduces (gradient accumulation's non-last microbatches, as DDP's no_sync)."""
        before, self.sync = self.sync, not enabled
        try:
            yield
        finally:
            self.sync = before

    def _hook(self, bucket: _Bucket):
        def hook(param: torch.Tensor) -> None:
            if not self.sync:
                return
            if bucket.work is not None:
                raise RuntimeError(
                    "a replicated parameter's gradient was accumulated again after its bucket's all-reduce started: "
                    "call Replicated.allreduce_grads() after each backward")
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.launch()
        return hook

    def allreduce_grads(self) -> None:
        """Average every replicated gradient over its group: finish the bucketed all-reduces (launching those whose
        gradients did not all arrive), or, without buckets, one synchronous flat all-reduce per group."""
        if self.buckets:
            for bucket in self.buckets:
                bucket.finish()
            bucketed = {id(p) for b in self.buckets for p in b.params}
            rest = [(g, [p for p in g.params if id(p) not in bucketed]) for g in self.groups]
        else:
            rest = [(g, g.params) for g in self.groups]
        for g, params in rest:
            allreduce_replicated_grads(params, group=g.group, scale=g.grad_scale)

    def broadcast(self) -> None:
        for g in self.groups:
            broadcast_replicated_params(g.params, group=g.broadcast_group or g.group)


def avg_supported(group: dist.ProcessGroup | None) -> bool:
    """Whether the group's backend all-reduces with ReduceOp.AVG: tried on a one-element tensor (a collective;
    every rank calls it at the same point) and checked to give the mean."""
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    probe = torch.full((1,), float(dist.get_rank(group) + 1), device=device)
    try:
        dist.all_reduce(probe, op=dist.ReduceOp.AVG, group=group)
    except (RuntimeError, ValueError):
        return False
    size = dist.get_world_size(group)
    return abs(float(probe.item()) - (size + 1) / 2) < 1e-6  # at set-up: one sync


def allreduce_replicated_grads(params: list[nn.Parameter], *, group: dist.ProcessGroup | None = None,
                               scale: float | None = None) -> None:
    """Sum the gradients of replicated parameters over `group` in one flat all-reduce and multiply by `scale`
    (default 1/group size: the average). DTensor gradients (tensor/expert-sharded) reduce their local shards."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if not grads or not dist.is_initialized():
        return
    size = dist.get_world_size(group)
    scale = 1.0 / size if scale is None else scale
    if size == 1 and scale == 1.0:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    if size > 1:
        dist.all_reduce(flat, group=group)
    flat *= scale
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def broadcast_replicated_params(params: list[nn.Parameter], *, group: dist.ProcessGroup | None = None) -> None:
    """Make the group's first rank's values of the replicated parameters every member's (after initialisation or
    loading): random init of sharded DTensors may consume each rank's generator differently, so plain-tensor init
    alone cannot be trusted to agree. DTensor parameters broadcast their local shards."""
    if not params or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([_local(p.detach()).reshape(-1).float() for p in params])
    dist.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    offset = 0
    for p in params:
        local = _local(p.data)
        local.copy_(flat[offset:offset + local.numel()].view_as(local))
        offset += local.numel()
