"""FSDP2's reduce-scatter with its buffers from the compute stream's allocator pool
(parallelism.fsdp_reduce_in_compute_pool).

Why: FSDP2 allocates each unit's reduce output, the sharded gradients it keeps, on its reduce-scatter stream, and
the caching allocator reuses a freed block only on the stream that allocated it. So the previous step's gradients,
freed by zero_grad, stay reserved in that stream's pool while the next step's activations (or, accumulating, the
unsharded gradients: distributed/grad_accumulation.py) fill the compute stream's: on the proxy at 8 rows per step
the H200's reserved peak was 131.96 GiB where 103.8 were allocated by plan (docs/performance.md, sixteenth
session). Allocated from the compute stream instead, they are one pool. Safe by FSDP2's own ordering: the reduce
stream waits for the compute stream before it writes the output, so no earlier user of the block is pending; the
output stays referenced (as .grad) until the compute stream has waited for the reduce at the end of backward and
the optimizer has stepped. FSDP2's public set_custom_reduce_scatter takes it (an object with its ReduceScatter
interface: allocate and the call; the base class is not exported); the collective itself is the default one. Used
only where no parameter is split over ranks (the reduce is then a copy; train.py refuses the key elsewhere), which
is where the key, left unset, turns it on (compute_pool_wanted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["ComputePoolReduceScatter", "compute_pool_applies", "compute_pool_wanted", "custom_reduce_scatter_supported",
           "use_compute_pool_reduce"]


def custom_reduce_scatter_supported() -> bool:
    """Whether this torch's FSDP2 takes a custom reduce-scatter (set_custom_reduce_scatter)."""
    return hasattr(FSDPModule, "set_custom_reduce_scatter")


def compute_pool_applies(*, splits_parameters: bool, cpu_offload: bool) -> bool:
    """Where the reduce is a copy whose output the compute stream may own: no parameter split over ranks, and the
    gradients on the device (no optimizer.cpu_offload)."""
    return not splits_parameters and not cpu_offload


def compute_pool_wanted(setting: bool | None, *, splits_parameters: bool, cpu_offload: bool) -> bool:
    """parallelism.fsdp_reduce_in_compute_pool resolved: as set (train.py refuses true where it does not apply), or
    when unset wherever it applies on a torch that supports it."""
    if setting is not None:
        return setting
    return (compute_pool_applies(splits_parameters=splits_parameters, cpu_offload=cpu_offload)
            and custom_reduce_scatter_supported())


class ComputePoolReduceScatter:
    """FSDP2's reduce-scatter, its input and output allocated on `stream` (the training loop's); `allocated` counts
    the bytes it handed out (what a test can see of it on CPU, where there are no streams)."""

    def __init__(self, stream: torch.Stream | None) -> None:
        self.stream = stream
        self.allocated = 0

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        if self.stream is None:  # CPU: one "stream"
            out = torch.empty(*size, dtype=dtype, device=device)
        else:
            with torch.cuda.stream(self.stream):
                out = torch.empty(*size, dtype=dtype, device=device)
        self.allocated += out.numel() * out.element_size()
        return out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def use_compute_pool_reduce(model: nn.Module, *, device_type: str) -> ComputePoolReduceScatter:
    """Install one ComputePoolReduceScatter on every FSDP2 unit of `model` (after fully_shard), on the stream that
    is current now on the current device (the training loop's)."""
    comm = ComputePoolReduceScatter(torch.cuda.current_stream() if device_type == "cuda" else None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(comm)
    return comm
