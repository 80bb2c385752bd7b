"""Parallel degrees, their validation (config errors before any process group) and the named device meshes.

The mesh is TorchTitan's (v0.2.0 layout, expert tensor parallel = 1): dims (dp_replicate, dp_shard, cp, tp), and when
expert parallelism is on, dp_shard is split into (dp_shard_mod_ep, dp_shard_in_ep) so that the expert mesh
ep = dp_shard_in_ep x cp borrows its ranks from the data-parallel shard and context dims. Flattened meshes:
  dp          = dp_replicate x dp_shard         data loading (which rows a rank reads)
  dp_shard_cp = dp_shard x cp                   FSDP2 of everything but the routed experts
  dp_cp       = dp_replicate x dp_shard x cp    gradient/loss/token-count reductions, router loads
  ep          = dp_shard_in_ep x cp             routed experts sharded, token all-to-all
  edp         = dp_replicate x dp_shard_mod_ep  ranks holding the same experts (their gradients are averaged)
Every dim exists even at size 1, so every named mesh always resolves.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan_glm.config import ConfigError, ParallelismConfig

_KEY = "parallelism."


def world_size_from_env() -> int:
    """The world size torchrun exported (WORLD_SIZE), 1 for a plain `python train.py`: known before any process
    group starts, so layout errors can exit 2 on every rank alike."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: ParallelismConfig, *, world_size: int) -> "ParallelDims":
        """Resolve data_parallel_shard_degree=-1 and check the layout against the world size (ConfigError naming the
        keys)."""
        rep, cp, tp, ep = (cfg.data_parallel_replicate_degree, cfg.context_parallel_degree,
                           cfg.tensor_parallel_degree, cfg.expert_parallel_degree)
        others = rep * cp * tp
        shard = cfg.data_parallel_shard_degree
        if shard == -1:
            if world_size % others != 0:
                raise ConfigError(
                    f"{_KEY}data_parallel_replicate_degree/context_parallel_degree/tensor_parallel_degree",
                    f"their product {rep} x {cp} x {tp} = {others} does not divide the world size {world_size}, so "
                    f"{_KEY}data_parallel_shard_degree=-1 cannot take the rest")
            shard = world_size // others
        if rep * shard * cp * tp != world_size:
            raise ConfigError(
                f"{_KEY}data_parallel_shard_degree",
                f"data_parallel_replicate_degree ({rep}) x data_parallel_shard_degree ({shard}) x "
                f"context_parallel_degree ({cp}) x tensor_parallel_degree ({tp}) = {rep * shard * cp * tp} "
                f"is not the world size {world_size}")
        if ep > 1 and ((shard * cp) % ep != 0 or ep % cp != 0):
            raise ConfigError(
                f"{_KEY}expert_parallel_degree",
                f"{ep} must divide data_parallel_shard_degree x context_parallel_degree = {shard} x {cp} = "
                f"{shard * cp} and be a multiple of context_parallel_degree ({cp}): expert parallelism borrows "
                "its ranks from the shard and context dims")
        return cls(dp_replicate=rep, dp_shard=shard, cp=cp, tp=tp, ep=ep, world_size=world_size)

    # ------------------------------------------------------------------ sizes
    @property
    def dp(self) -> int:
        """Data-parallel degree (distinct batches per step)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that see different tokens (gradient-averaging degree)."""
        return self.dp * self.cp

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def edp(self) -> int:
        """Ranks that hold the same experts: dp_replicate x (dp_shard x cp / ep)."""
        return self.dp_replicate * self.fsdp // self.ep

    @property
    def splits_parameters(self) -> bool:
        """Whether some parameter is split over ranks (FSDP2's shards, tensor or expert parallelism); where none is,
        FSDP2's reduce is a copy (and an all-reduce over replicas)."""
        return self.fsdp > 1 or self.tp > 1 or self.ep > 1

    def describe(self) -> str:
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} tp={self.tp} "
                f"ep={self.ep} (world {self.world_size})")

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str) -> dict[str, DeviceMesh]:
        """Every named mesh, created once (so all process groups exist) and kept by name: torch deprecates slicing
        flattened dims back out of the root mesh. Keys: world, dp_replicate, dp_shard, cp, tp, dp, dp_shard_cp,
        dp_cp, fsdp (the dense FSDP2 mesh: 2-D (dp_replicate, dp_shard_cp) under HSDP) and, with ep > 1, ep, edp
        (dp_replicate x dp_shard_mod_ep: the ranks that hold the same experts) and experts (the 2-D (edp, ep))."""
        if self.ep > 1:
            in_ep = self.ep // self.cp
            names = ("dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
            shape = (self.dp_replicate, self.dp_shard // in_ep, in_ep, self.cp, self.tp)
            shard_dims: tuple[str, ...] = ("dp_shard_mod_ep", "dp_shard_in_ep")
        else:
            names = ("dp_replicate", "dp_shard", "cp", "tp")
            shape = (self.dp_replicate, self.dp_shard, self.cp, self.tp)
            shard_dims = ("dp_shard",)
        world = init_device_mesh(device_type, shape, mesh_dim_names=names)
        meshes = {"world": world, "dp_replicate": world["dp_replicate"], "cp": world["cp"], "tp": world["tp"]}
        meshes["dp_shard"] = world[shard_dims]._flatten("dp_shard") if self.ep > 1 else world["dp_shard"]
        meshes["dp"] = world[("dp_replicate", *shard_dims)]._flatten("dp")
        meshes["dp_shard_cp"] = world[(*shard_dims, "cp")]._flatten("dp_shard_cp")
        meshes["dp_cp"] = world[("dp_replicate", *shard_dims, "cp")]._flatten("dp_cp")
        meshes["fsdp"] = meshes["dp_shard_cp"]
        if self.dp_replicate > 1:  # HSDP: replicate x shard; the sub-mesh of two flattened dims needs a slice
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                meshes["fsdp"] = world["dp_replicate", "dp_shard_cp"]
        if self.ep > 1:
            meshes["ep"] = world[("dp_shard_in_ep", "cp")]._flatten("ep")
            meshes["edp"] = world[("dp_replicate", "dp_shard_mod_ep")]._flatten("edp")
            with warnings.catch_warnings():  # (edp, ep): where parallelism.expert_fsdp's expert DTensors live
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                meshes["experts"] = world["edp", "ep"]
        return meshes


def validate_model_layout(dims: ParallelDims, args, *, seq_len: int, expert_fsdp: bool = False) -> None:
    """Model-dependent layout rules (heads / experts / sequence divisibility) as ConfigErrors naming the keys.

    Runs right after the model args are built and before any process group starts. `args` is a Glm5ModelArgs.
    """
    tp, ep, cp = dims.tp, dims.ep, dims.cp
    if tp > 1:
        for name, value in (("linear_num_heads", args.linear_num_heads), ("num_attention_heads",
                            args.num_attention_heads)):
            if value % tp:
                raise ConfigError(f"{_KEY}tensor_parallel_degree",
                                  f"{tp} does not divide the model's {name} ({value}): heads are split over "
                                  "tensor-parallel ranks")
        mlp = [("intermediate_size", args.intermediate_size)]
        if any(t == "sparse" for t in args.mlp_layer_types):
            mlp.append(("moe_intermediate_size x n_shared_experts", args.moe_intermediate_size * args.n_shared_experts))
        for name, value in mlp:
            if value % tp:
                raise ConfigError(f"{_KEY}tensor_parallel_degree",
                                  f"{tp} does not divide the model's {name} ({value}): MLP columns are split over "
                                  "tensor-parallel ranks")
    if ep > 1 and args.n_routed_experts % ep:
        raise ConfigError(f"{_KEY}expert_parallel_degree",
                          f"{ep} does not divide the model's n_routed_experts ({args.n_routed_experts})")
    if ep > 1 and expert_fsdp and dims.edp > 1:
        for name, value in (("moe_intermediate_size", args.moe_intermediate_size), ("hidden_size", args.hidden_size)):
            if value % dims.edp:
                raise ConfigError(f"{_KEY}expert_fsdp",
                                  f"the {dims.edp} ranks that hold the same experts (world / tensor_parallel / "
                                  f"expert_parallel) do not divide the model's {name} ({value}), along which the "
                                  "experts' rows are sharded; set it false or choose another expert_parallel_degree")
    if cp > 1:
        unit = 2 * cp * args.index_kpool
        if seq_len % unit:
            raise ConfigError(
                "training.seq_len",
                f"{seq_len} must be divisible by 2 x {_KEY}context_parallel_degree x index_kpool = 2 x {cp} x "
                f"{args.index_kpool} = {unit}: each row is cut into 2 x cp zigzag chunks of whole KPool pools")
