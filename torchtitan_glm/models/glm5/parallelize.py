"""The GLM-5 parallelisation recipe: activation checkpointing -> per-block compile -> FSDP2.

Parameters the blocks declare FP32-kept (`keep_fp32`: mHC maps, KDA A_log/dt_bias and short convs, router,
KPool APE) stay out of the BF16 FSDP groups: they are replicated in FP32 (a few hundred MB for the full model)
and their gradients are averaged by `allreduce_replicated_grads`. Nested FSDP groups would be the alternative,
but their hooks would run inside the compiled blocks and break fullgraph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.compile import apply_compile

from .layers import fp32_kept_modules

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fp32_kept_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for m in fp32_kept_modules(module) for p in m.parameters(recurse=False)]


def parallelize_glm5(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    param_dtype: str,
    reduce_dtype: str,
    ac_mode: str,
    compile_enable: bool,
    compile_backend: str = "inductor",
    compile_mode: str = "default",
    compile_components: list[str] | None = None,
) -> list[nn.Parameter]:
    """Apply AC, compile and FSDP2 in place; returns the replicated FP32-kept parameters."""
    apply_activation_checkpointing(model, mode=ac_mode)
    if compile_enable:
        apply_compile(model, backend=compile_backend, mode=compile_mode, components=compile_components or ["model"])
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    replicated = fp32_kept_params(model)
    blocks = list(model.layers.values()) + ([model.mtp] if getattr(model, "mtp", None) is not None else [])
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True,
                    ignored_params=set(fp32_kept_params(block)))
    fully_shard(model.embed_tokens, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    # The head is called once per step after the trunk; keep it gathered from the final norm to the loss.
    fully_shard([model.norm, model.lm_head], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=set(replicated))
    return replicated


def allreduce_replicated_grads(params: list[nn.Parameter], *, group: dist.ProcessGroup | None = None) -> None:
    """Average the gradients of replicated parameters over the data-parallel group in one flat all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def broadcast_replicated_params(params: list[nn.Parameter], *, group: dist.ProcessGroup | None = None) -> None:
    """Make rank 0's values of the replicated parameters every rank's (after initialisation or loading): random
    init of sharded DTensors may consume each rank's generator differently, so plain-tensor init alone cannot
    be trusted to agree."""
    if not params or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    dist.broadcast(flat, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
