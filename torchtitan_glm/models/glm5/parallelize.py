"""The GLM-5 parallelisation recipe, in TorchTitan's order: tensor parallel -> expert parallel -> activation
checkpointing -> per-block compile -> FSDP2.

Tensor parallel (DTensor `parallelize_module`, heads and MLP columns split over the tp mesh, no sequence parallel):
  KDA   q/k/v, f_b, g_b, b column-wise; their short convs and A_log/dt_bias sharded per channel/head; f_a, g_a
        replicated; o_proj row-wise; the per-head output norm's weight replicated (a partial-sum gradient).
  MLA   q_b, kv_b column-wise; q_a, kv_a and their norms replicated; o_proj row-wise. The indexer stays replicated:
        it is small (index_n_heads x 128 for queries, one 128-wide key) and its top-k needs the head-weighted sum of
        every head's score, so splitting it would add an all-reduce of a [B, T, T/kpool] tensor per layer for a few
        percent of the layer's FLOPs; the KL target gathers the other ranks' MLA heads (SparseMLA.heads_group).
  MLP   dense and shared-expert gate/up column-wise, down row-wise.
  torchao Float8Linear modules take torchao's Float8ColwiseParallel / Float8RowwiseParallel (FP8 all-gathers, which
  assume tensorwise scaling); with a rowwise recipe they take the plain styles.
  Everything else (mHC, norms, router, embeddings, LM head, routed experts) is replicated over tp and computed
  redundantly. Sequence parallelism (norms and mHC on T/tp tokens) is not applied: the layers receive per-token
  document layouts for the whole row (DocLayout, doc_ids), so splitting T inside a layer needs those sliced too --
  that belongs with the batch-layout object (issue 10, item 8); it would cut the mHC streams' activation memory.
Expert parallel: each MoE's routed experts are sharded Shard(0) over the ep mesh (E/ep per rank) and exchange tokens
  with all-to-alls inside one custom op (ops/expert_parallel.py). They are kept out of FSDP2 (a nested FSDP group
  would put hooks inside the compiled block, and the block's own group cannot hold parameters sharded over an
  overlapping mesh). With parallelism.expert_fsdp (the default) the ranks that hold the same experts (edp) each keep
  1/edp of their rows, a 2-D [Shard(1), Shard(0)] DTensor on (edp, ep), and the op gathers them and reduce-scatters
  their gradients (ZeRO-3 inside the op, FSDP2's memory without its hooks); without it every rank keeps its experts
  whole and the edp ranks average their gradients like the FP32-kept parameters.
FP32-kept parameters (`keep_fp32`: mHC maps, A_log/dt_bias, short convs, router, KPool APE, FP32 norms) stay out of
the BF16 FSDP groups (nested FP32 groups break fullgraph): replicated over the data/context ranks (and sharded
over tp where the plan says so), their gradients averaged by `Replicated.allreduce_grads` (bucketed all-reduces
launched during backward, distributed/replicated.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard, register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.compile import apply_compile
from torchtitan_glm.config import reshard_after_forward
from torchtitan_glm.distributed.fsdp_comms import use_compute_pool_reduce
from torchtitan_glm.distributed.replicated import DEFAULT_BUCKET_BYTES, ReplicaGroup, Replicated

from .dsa import SparseMLA
from .kda import KimiDeltaAttention
from .layers import DenseMLP, fp32_kept_modules
from .moe import GroupedExperts, MoE

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fp32_kept_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for m in fp32_kept_modules(module) for p in m.parameters(recurse=False)]


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.layers.values()) + ([model.mtp] if getattr(model, "mtp", None) is not None else [])


# ------------------------------------------------------------------------------------------ tensor parallel
class HeadLocalParams(ParallelStyle):
    """The parameters of a module that computes on its rank's heads become DTensors on the tp mesh, all with one
    placement: Shard(0) for per-channel / per-head values, Replicate for values shared by all heads. The module reads
    them through layers.local_param. Parameter dtypes are kept (FP32 stays FP32)."""

    def __init__(self, placement) -> None:
        super().__init__()
        self.placement = placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            if mod is not module:
                return
            for pname, p in list(mod.named_parameters(recurse=False)):
                dt = distribute_tensor(p.data, mesh, [self.placement])
                mod.register_parameter(pname, nn.Parameter(dt, requires_grad=p.requires_grad))

        return distribute_module(module, device_mesh, partition)


def _linear_styles(module: nn.Module) -> tuple[type, type]:
    """(column-wise, row-wise) styles for a Linear: torchao's FP8 ones for a tensorwise Float8Linear."""
    try:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return ColwiseParallel, RowwiseParallel
    if isinstance(module, Float8Linear) and \
            module.config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE:
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        return Float8ColwiseParallel, Float8RowwiseParallel
    return ColwiseParallel, RowwiseParallel


def _colwise(module: nn.Module, name: str) -> ParallelStyle:
    return _linear_styles(getattr(module, name))[0]()


def _rowwise(module: nn.Module, name: str) -> ParallelStyle:
    return _linear_styles(getattr(module, name))[1]()


def tp_plan_kda(attn: KimiDeltaAttention) -> dict[str, ParallelStyle]:
    plan = {n: _colwise(attn, n) for n in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "b_proj")}
    plan.update({n: HeadLocalParams(Shard(0)) for n in ("q_conv1d", "k_conv1d", "v_conv1d", "decay")})
    plan["o_norm"] = HeadLocalParams(Replicate())
    plan["o_proj"] = _rowwise(attn, "o_proj")
    return plan


def tp_plan_mla(attn: SparseMLA) -> dict[str, ParallelStyle]:
    return {"q_b_proj": _colwise(attn, "q_b_proj"), "kv_b_proj": _colwise(attn, "kv_b_proj"),
            "o_proj": _rowwise(attn, "o_proj")}


def tp_plan_mlp(mlp: DenseMLP) -> dict[str, ParallelStyle]:
    return {"gate_proj": _colwise(mlp, "gate_proj"), "up_proj": _colwise(mlp, "up_proj"),
            "down_proj": _rowwise(mlp, "down_proj")}


def apply_tensor_parallel(model: nn.Module, *, tp_mesh: DeviceMesh) -> None:
    """Split heads and MLP columns of every decoder layer and the MTP layer over tp_mesh (see module docstring)."""
    for block in _blocks(model):
        attn = block.self_attn
        if isinstance(attn, KimiDeltaAttention):
            parallelize_module(attn, tp_mesh, tp_plan_kda(attn))
        else:
            parallelize_module(attn, tp_mesh, tp_plan_mla(attn))
            attn.heads_group = tp_mesh.get_group()
        mlp = block.mlp
        dense = mlp.shared_experts if isinstance(mlp, MoE) else mlp
        parallelize_module(dense, tp_mesh, tp_plan_mlp(dense))


# ------------------------------------------------------------------------------------------ expert parallel
def apply_expert_parallel(model: nn.Module, *, ep_mesh: DeviceMesh, expert_mesh: DeviceMesh | None = None,
                          grad_scale: float = 1.0) -> list[nn.Parameter]:
    """Shard every MoE's routed experts over ep_mesh (Shard(0) of the stacked weights); returns their parameters.

    expert_mesh: the 2-D (edp, ep) mesh (parallelism.expert_fsdp): the experts' rows are also sharded over edp,
    [Shard(1), Shard(0)], and their op reduce-scatters the gradients over it, times grad_scale."""
    params = []
    for module in model.modules():
        if not isinstance(module, GroupedExperts):
            continue
        if expert_mesh is None:
            HeadLocalParams(Shard(0))._apply(module, ep_mesh)
        else:
            for name, p in list(module.named_parameters(recurse=False)):
                dt = distribute_tensor(p.data, expert_mesh, [Shard(1), Shard(0)])
                module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
            module.shard_group = expert_mesh.get_group("edp")
            module.grad_scale = grad_scale
        module.ep_group = ep_mesh.get_group()
        params += list(module.parameters(recurse=False))
    return params


# ------------------------------------------------------------------------------------------ the recipe
def parallelize_glm5(
    model: nn.Module,
    *,
    meshes: dict[str, DeviceMesh],
    param_dtype: str,
    reduce_dtype: str,
    ac_mode: str,
    compile_enable: bool,
    recompute_modules: tuple[str, ...] | list[str] = (),
    moe_chunk_tokens: int = 0,
    offload_inputs: bool = False,
    kda_disable_recompute: bool = False,
    compile_backend: str = "inductor",
    compile_mode: str = "default",
    compile_components: list[str] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    cpu_offload: bool = False,
    expert_fsdp: bool = False,
    fsdp_reshard: str = "default",
    reduce_in_compute_pool: bool = False,
) -> Replicated:
    """TP -> EP -> AC -> compile -> FSDP2 in place (meshes from ParallelDims.build_mesh); returns the parameters kept
    out of FSDP2 and how to keep them in sync (their gradient all-reduces overlap with backward, in buckets of
    `bucket_bytes`; distributed/replicated.py). cpu_offload: FSDP2 keeps the sharded parameters, their gradients
    (and so the optimizer's states) in (pinned, on a GPU) host memory; the parameters kept out of FSDP2 stay put.
    expert_fsdp: shard the routed experts over the expert-data ranks too (see apply_expert_parallel). offload_inputs:
    the full-AC blocks' saved inputs wait for backward in host memory (activation_checkpoint.HostOffload).
    kda_disable_recompute: the KDA ops keep FLA's forward intermediates for backward (activation_checkpoint).
    fsdp_reshard: parallelism.fsdp_reshard_after_forward (config.reshard_after_forward). reduce_in_compute_pool:
    parallelism.fsdp_reduce_in_compute_pool (distributed/fsdp_comms.py)."""
    tp, ep = meshes["tp"], meshes.get("ep")
    dp_cp_size = meshes["dp_cp"].size()
    if tp.size() > 1:
        apply_tensor_parallel(model, tp_mesh=tp)
    experts: list[nn.Parameter] = []
    sharded_experts = expert_fsdp and ep is not None and ep.size() > 1 and meshes["edp"].size() > 1
    if ep is not None and ep.size() > 1:
        experts = apply_expert_parallel(model, ep_mesh=ep, expert_mesh=meshes["experts"] if sharded_experts else None,
                                        grad_scale=1.0 / dp_cp_size)
    apply_activation_checkpointing(model, mode=ac_mode, recompute_modules=recompute_modules,
                                   moe_chunk_tokens=moe_chunk_tokens, offload_inputs=offload_inputs,
                                   kda_disable_recompute=kda_disable_recompute)
    if compile_enable:
        apply_compile(model, backend=compile_backend, mode=compile_mode, components=compile_components or ["model"])

    mesh = meshes["fsdp"]
    mp = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    kept = fp32_kept_params(model)
    outside = set(kept) | set(experts)
    trunk_reshard = reshard_after_forward(fsdp_reshard, head=False)
    for block in _blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=trunk_reshard, offload_policy=offload,
                    ignored_params={p for p in block.parameters() if p in outside})
    fully_shard(model.embed_tokens, mesh=mesh, mp_policy=mp, reshard_after_forward=trunk_reshard,
                offload_policy=offload)
    # The head is called once per step after the trunk: by default kept gathered from the final norm to the loss.
    fully_shard([model.norm, model.lm_head], mesh=mesh, mp_policy=mp,
                reshard_after_forward=reshard_after_forward(fsdp_reshard, head=True), offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=outside,
                offload_policy=offload)
    register_fsdp_forward_method(model, "logits")  # the inference entry gets the root's FSDP hooks too
    if reduce_in_compute_pool:
        use_compute_pool_reduce(model, device_type=mesh.device_type)

    dp_cp = meshes["dp_cp"].get_group()
    plain = [p for p in kept if not isinstance(p, DTensor)]
    sharded = [p for p in kept if isinstance(p, DTensor)]
    out = Replicated()
    # FP32-kept: the data/context ranks see different tokens (sum / their count); plain ones are also equal over tp
    out.groups.append(ReplicaGroup(plain, dp_cp, 1.0 / dp_cp_size, broadcast_group=dist.group.WORLD))
    if sharded:
        out.groups.append(ReplicaGroup(sharded, dp_cp, 1.0 / dp_cp_size))
    if experts and not sharded_experts:
        # each owner already summed its ep group's tokens (the all-to-all backward); add the other expert replicas
        out.groups.append(ReplicaGroup(experts, meshes["edp"].get_group(), 1.0 / dp_cp_size))
    out.overlap_with_backward(order=reversed(_blocks(model)), bucket_bytes=bucket_bytes)
    return out
