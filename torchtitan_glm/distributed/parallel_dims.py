"""Parallel degrees and the device mesh. Today: FSDP2 data-parallel sharding over all ranks (TP/EP/CP later)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    dp_shard: int
    world_size: int

    @classmethod
    def from_config(cls, *, dp_shard: int, world_size: int) -> "ParallelDims":
        degree = world_size if dp_shard == -1 else dp_shard
        if degree != world_size:
            raise ValueError(
                f"parallelism.data_parallel_shard_degree={dp_shard} must be -1 or the world size {world_size} "
                "(tensor/expert/context parallel degrees arrive in a later release)")
        return cls(dp_shard=degree, world_size=world_size)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
