"""The model a plan is about, read from the trainer's own construction: `train.build_model_args(cfg)`, `Glm5Model` on
the meta device, `float8.convert_float8`, the dense-warm-up freeze, and parallelize.py's FSDP2 units and FP32-kept
(replicated) parameters. Nothing here restates the architecture: shapes, roles and units come from the modules."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchtitan_glm.config import FLOAT8_ROLES, JobConfig, reshard_after_forward
from torchtitan_glm.float8 import convert_float8, param_precisions
from torchtitan_glm.models.glm5 import Glm5Model
from torchtitan_glm.models.glm5.args import Glm5ModelArgs
from torchtitan_glm.models.glm5.kda import KimiDeltaAttention
from torchtitan_glm.models.glm5.moe import GroupedExperts, MoE
from torchtitan_glm.models.glm5.parallelize import fp32_kept_params

@dataclass(frozen=True)
class Param:
    """One parameter as the trainer holds it: shape, whether FSDP2 manages it or it is replicated FP32, whether it is
    a routed-expert weight (sharded by expert parallelism), trainable, and the dim parallelize.py's tensor-parallel
    plan splits (None: whole on every tensor-parallel rank)."""

    fqn: str
    shape: tuple[int, ...]
    dtype_bytes: int
    replicated: bool
    expert: bool
    trainable: bool
    tp_dim: int | None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Unit:
    """One compute block in forward order with the parameters of its FSDP2 unit (parallelize.py's wrapping):
    kind is kda_dense | kda_moe | dsa_dense | dsa_moe (decoder layers), mtp, embed or head (final norm + LM head)."""

    name: str
    kind: str
    params: tuple[Param, ...]
    reshard_after_forward: bool
    replicated: tuple[Param, ...] = ()  # FP32-kept parameters inside the block (outside its FSDP unit)
    shared_indexer: bool = False


@dataclass(frozen=True)
class ModelInventory:
    args: Glm5ModelArgs
    units: tuple[Unit, ...]
    buffer_bytes: int
    float8_line: str
    expert_fp8: bool  # routed experts run FP8 grouped GEMMs
    fp8_roles: frozenset[str]  # Linear roles converted to Float8Linear
    fp8_recipe: str | None
    dense_fp8_fraction: float  # of the dense projections' weight elements, those Float8Linear converts
    dense_tp_fraction: float  # of the dense projections' weight elements, those tensor parallelism splits
    optimizer: str = "AdamW"  # optimizer.name: AdamW keeps both moments in the parameters' dtype, the low-bit ones 1 B
    optimizer_implementation: str = "fused"  # optimizer.implementation as run on a GPU (the step's time)

    @property
    def params(self) -> list[Param]:
        return [p for u in self.units for p in (*u.params, *u.replicated)]

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)


def build_meta_model(cfg: JobConfig, *, args: Glm5ModelArgs | None = None) -> tuple[Glm5Model, str]:
    """The trainer's model on the meta device: build_model_args, Glm5Model, convert_float8, dense-warm-up freeze (the
    same three statements as Trainer.__init__, which has no hook to call instead)."""
    if args is None:
        from torchtitan_glm.train import build_model_args

        args = build_model_args(cfg)
    with torch.device("meta"):
        model = Glm5Model(args)
    summary = convert_float8(model, cfg=cfg.float8)
    if cfg.loss.indexer_stage == "dense_warmup":
        for name, p in model.named_parameters():
            p.requires_grad_(p.requires_grad and ".indexer." in name)
    return model, summary.line()


def _owners(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    out = {}
    for _, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            out.setdefault(id(p), (module, name))
    return out


def tensor_parallel_dims(model: Glm5Model) -> dict[int, int]:
    """id(parameter) -> the dim parallelize.py's tensor-parallel plan shards it on, read from the plan's own styles
    (tp_plan_kda / tp_plan_mla / tp_plan_mlp): column-wise Linears dim 0, row-wise Linears dim 1 (their bias
    replicated), head-local parameters their placement's dim. Parameters absent are whole on every tp rank."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from torchtitan_glm.models.glm5.parallelize import (
        HeadLocalParams, tp_plan_kda, tp_plan_mla, tp_plan_mlp,
    )

    out: dict[int, int] = {}
    blocks = list(model.layers.values()) + ([model.mtp] if model.mtp is not None else [])
    for block in blocks:
        attn, mlp = block.self_attn, block.mlp
        dense = mlp.shared_experts if isinstance(mlp, MoE) else mlp
        plans = [(attn, tp_plan_kda(attn) if isinstance(attn, KimiDeltaAttention) else tp_plan_mla(attn)),
                 (dense, tp_plan_mlp(dense))]
        for parent, plan in plans:
            for child, style in plan.items():
                module = getattr(parent, child)
                for pname, p in module.named_parameters(recurse=False):
                    if isinstance(style, ColwiseParallel):
                        out[id(p)] = 0
                    elif isinstance(style, RowwiseParallel) and pname == "weight":
                        out[id(p)] = 1
                    elif isinstance(style, HeadLocalParams) and isinstance(style.placement, Shard):
                        out[id(p)] = style.placement.dim
    return out


def inventory(model: Glm5Model, float8_line: str, *, recipe: str | None,
              fsdp_reshard: str = "default") -> ModelInventory:
    """Units and parameters of a meta model built by `build_meta_model` (`recipe`: float8.recipe when enabled;
    `fsdp_reshard`: parallelism.fsdp_reshard_after_forward, as parallelize.py applies it)."""
    args = model.args
    kept = {id(p) for p in fp32_kept_params(model)}
    owners = _owners(model)
    tp_dims = tensor_parallel_dims(model)

    def describe(prefix: str, module: nn.Module) -> list[Param]:
        out = []
        for name, p in module.named_parameters():
            owner, _ = owners[id(p)]
            out.append(Param(fqn=f"{prefix}.{name}" if prefix else name, shape=tuple(p.shape),
                             dtype_bytes=p.element_size(), replicated=id(p) in kept,
                             expert=isinstance(owner, GroupedExperts), trainable=p.requires_grad,
                             tp_dim=tp_dims.get(id(p))))
        return out

    def unit(name: str, kind: str, modules: list[tuple[str, nn.Module]], reshard: bool, **kw) -> Unit:
        params = [q for prefix, m in modules for q in describe(prefix, m)]
        return Unit(name, kind, tuple(q for q in params if not q.replicated), reshard,
                    tuple(q for q in params if q.replicated), **kw)

    trunk = reshard_after_forward(fsdp_reshard, head=False)
    units = [unit("embed_tokens", "embed", [("embed_tokens", model.embed_tokens)], trunk)]
    for i, layer in model.layers.items():
        kind = ("dsa" if layer.is_dsa else "kda") + ("_moe" if layer.is_moe else "_dense")
        shared = layer.is_dsa and layer.self_attn.indexer is None
        units.append(unit(f"layers.{i}", kind, [(f"layers.{i}", layer)], trunk, shared_indexer=shared))
    head = [("norm", model.norm), ("lm_head", model.lm_head)]
    if getattr(model, "hc_head", None) is not None:
        head.append(("hc_head", model.hc_head))
    units.append(unit("head", "head", head, reshard_after_forward(fsdp_reshard, head=True)))
    if model.mtp is not None:
        units.append(unit("mtp", "mtp", [("mtp", model.mtp)], trunk))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    rows = param_precisions(model)
    fp8_roles = frozenset(r["role"] for r in rows if r["precision"].startswith("fp8") and r["role"] != "experts")
    expert_fp8 = any(r["role"] == "experts" and r["precision"].startswith("fp8") for r in rows)
    if not fp8_roles and not expert_fp8:
        recipe = None
    dense = [r for r in rows if r["role"] in FLOAT8_ROLES]
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    total = sum(sizes[r["fqn"]] for r in dense)
    fp8_share = sum(sizes[r["fqn"]] for r in dense if r["precision"].startswith("fp8")) / total if total else 0.0
    by_fqn = {q.fqn: q for u in units for q in (*u.params, *u.replicated)}
    tp_share = sum(sizes[r["fqn"]] for r in dense if by_fqn[r["fqn"]].tp_dim is not None) / total if total else 0.0
    return ModelInventory(args=args, units=tuple(units), buffer_bytes=buffers, float8_line=float8_line,
                          expert_fp8=expert_fp8, fp8_roles=fp8_roles, fp8_recipe=recipe,
                          dense_fp8_fraction=fp8_share, dense_tp_fraction=tp_share)
