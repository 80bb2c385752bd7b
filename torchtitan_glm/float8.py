"""FP8 training through torchao with the serving precision split; the one place that decides what runs in FP8.

Each block declares the role of every Linear it owns (`linear_roles`: kda | mla | indexer | mlp | shared_expert |
mtp) and which Linears it reads only through their weight (`weight_only_linears`: a Float8Linear there would
silently run in BF16). A Linear is converted to torchao's Float8Linear when its role is not kept BF16, it is called
as a module, and both its dims divide by 16 (torchao's requirement). The routed experts (`GroupedExperts`) switch to
torchao's FP8 rowwise grouped GEMM. Never by name: `o_proj` is both a KDA and an MLA projection, `gate` the router,
the KPool gate and the experts' gate projection. The LM head and the router are not nn.Linear, so never converted.
Applied once, to the model on the meta device, before AC, compile and FSDP2; parameter names do not change, so
checkpoints move freely between BF16 and FP8 runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan_glm.config import SERVING_BF16_ROLES, ConfigError, Float8Config

__all__ = ["Float8Summary", "linear_roles", "fp8_convertible", "convert_float8", "float8_linear_class",
           "precompute_float8_scales", "configure_inductor_for_float8", "param_precisions", "plain_tensors",
           "cpu_scaled_mm_takes_row_scales", "check_float8_on_cpu"]


def float8_linear_class() -> type:
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear


def linear_roles(model: nn.Module) -> dict[str, str]:
    """fqn -> role of every nn.Linear in `model`, as its owning block declares it; raises for an undeclared one."""
    roles: dict[str, str] = {}
    for prefix, module in model.named_modules():
        for name, role in (getattr(module, "linear_roles", None) or {}).items():
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                roles[f"{prefix}.{name}" if prefix else name] = role
    undeclared = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in roles]
    if undeclared:
        raise ValueError(f"Linear modules without a declared role (add them to their block's linear_roles): "
                         f"{undeclared[:8]}")
    return roles


def _weight_only(model: nn.Module) -> set[str]:
    out = set()
    for prefix, module in model.named_modules():
        for name in getattr(module, "weight_only_linears", ()) or ():
            out.add(f"{prefix}.{name}" if prefix else name)
    return out


def fp8_convertible(model: nn.Module, *, keep_bf16: list[str] | tuple[str, ...]) -> dict[str, str]:
    """fqn -> role of the Linears the split runs in FP8: role not kept BF16, called as a module, dims % 16 == 0."""
    weight_only = _weight_only(model)
    modules = dict(model.named_modules())
    out = {}
    for fqn, role in linear_roles(model).items():
        w = modules[fqn].weight
        if role not in keep_bf16 and fqn not in weight_only and w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0:
            out[fqn] = role
    return out


def _expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from torchtitan_glm.models.glm5.moe import GroupedExperts

    return [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedExperts)]


def _experts_fp8_ok(experts: nn.Module) -> bool:
    return all(d % 16 == 0 for d in experts.gate_proj.shape[1:])


@dataclass
class Float8Summary:
    """What the conversion did, counted from the converted model."""

    recipe: str | None
    converted_linears: int = 0
    grouped_expert_weights: int = 0
    kept_bf16: dict[str, int] = field(default_factory=dict)  # role -> Linears kept BF16 by float8.keep_bf16
    left_bf16: dict[str, int] = field(default_factory=dict)  # role -> Linears of an FP8 role that stayed BF16
    experts_left_bf16: int = 0  # GroupedExperts modules left BF16 (a dim not divisible by 16)

    def line(self) -> str:
        """The one start-up line (rank 0; `precision_report.py` prints it too); recipe=off when float8 is disabled,
        and what an FP8 role left BF16 appended when anything was."""
        kept = ", ".join(f"{r}={n}" for r, n in self.kept_bf16.items())
        head = (f"float8: recipe={self.recipe or 'off'}, converted {self.converted_linears} Linear, "
                f"{self.grouped_expert_weights} grouped-expert weights; kept BF16 by role: {kept}")
        left = self._left()
        return f"{head}; {left}" if left else head

    def nothing_converted(self) -> str:
        """A warning when FP8 is on but the model has nothing in FP8 (every dim of its FP8 roles not divisible by 16,
        or keep_bf16 naming them all): the run would train BF16 unawares. Empty otherwise."""
        if self.recipe is None or self.converted_linears or self.grouped_expert_weights:
            return ""
        return ("float8.enable is true but no Linear and no routed expert was converted (see the float8 line "
                "above): this run trains in BF16")

    def _left(self) -> str:
        """What the split meant to run in FP8 but left BF16 (torchao's dims-divisible-by-16 rule, or a Linear read
        only through its weight); empty when nothing was."""
        parts = []
        if self.left_bf16:
            by_role = ", ".join(f"{r}={n}" for r, n in self.left_bf16.items())
            parts.append(f"{sum(self.left_bf16.values())} Linear ({by_role})")
        if self.experts_left_bf16:
            parts.append(f"{self.experts_left_bf16} routed-expert modules")
        if self.recipe is None or not parts:
            return ""
        return ("left BF16 although their role runs FP8 (a dim not divisible by 16, or read only through its "
                "weight): " + ", ".join(parts))


def summarize(model: nn.Module, *, recipe: str | None, keep_bf16: list[str] | tuple[str, ...],
              moe_experts: bool = True) -> Float8Summary:
    """Count converted Linears, FP8 expert weights, BF16-kept Linears per role (the serving roles always named,
    0 when converted) and what an FP8 role left BF16, in `model` as it is now."""
    f8 = float8_linear_class() if recipe is not None else None
    modules = dict(model.named_modules())
    roles = linear_roles(model)
    converted = sum(1 for m in modules.values() if f8 is not None and isinstance(m, f8))
    kept = Counter(r for fqn, r in roles.items() if r in keep_bf16 and not (f8 and isinstance(modules[fqn], f8)))
    left = Counter(r for fqn, r in roles.items() if f8 is not None and r not in keep_bf16
                   and not isinstance(modules[fqn], f8))
    experts = _expert_modules(model)
    named = [*SERVING_BF16_ROLES, *(r for r in keep_bf16 if r not in SERVING_BF16_ROLES)]
    return Float8Summary(recipe, converted, sum(3 for _, m in experts if m.fp8), {r: kept.get(r, 0) for r in named},
                         dict(sorted(left.items())),
                         sum(1 for _, m in experts if not m.fp8) if recipe is not None and moe_experts else 0)


def _linear_config(cfg: Float8Config):
    from torchao.float8 import Float8LinearConfig

    if cfg.recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.fsdp_float8_all_gather)
    return Float8LinearConfig.from_recipe_name(cfg.recipe)


def convert_float8(model: nn.Module, *, cfg: Float8Config) -> Float8Summary:
    """Convert `model` in place per `cfg` (a no-op when disabled) and return the counts."""
    if not cfg.enable:
        return summarize(model, recipe=None, keep_bf16=cfg.keep_bf16)
    from torchao.float8 import convert_to_float8_training

    chosen = set(fp8_convertible(model, keep_bf16=cfg.keep_bf16))
    convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn in chosen, config=_linear_config(cfg))
    if cfg.moe_experts:
        for _, experts in _expert_modules(model):
            experts.fp8 = _experts_fp8_ok(experts)
    return summarize(model, recipe=cfg.recipe, keep_bf16=cfg.keep_bf16, moe_experts=cfg.moe_experts)


def precompute_float8_scales(model: nn.Module, *, cfg: Float8Config) -> None:
    """After optimizer.step(): the scales of the FP8-all-gathered weights (tensorwise FSDP2 path), one amax
    all-reduce per group of weights sharded alike. torchao's function stacks the amaxes of all the weights it is
    given, which needs one device mesh: under tensor parallelism the TP-split weights live on the (dp, tp) mesh and
    the others on the dp mesh alone."""
    if not (cfg.enable and cfg.fsdp_float8_all_gather):
        return
    from torch.distributed.tensor import DTensor
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    f8 = float8_linear_class()
    groups: dict[tuple, list[nn.Module]] = {}
    for m in model.modules():
        if isinstance(m, f8) and isinstance(m.weight, DTensor):
            reduced = tuple(not p.is_replicate() for p in m.weight.placements)  # mesh dims the amax reduces over
            groups.setdefault((m.weight.device_mesh, reduced), []).append(m)
    for linears in groups.values():
        precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(linears))


def plain_tensors(state: object) -> object:
    """`state` (a nested state dict) with torchao's FP8-all-gather weight wrappers replaced by the plain tensors they
    wrap (same storage, so DCP still loads in place): checkpoints then hold ordinary tensors, which a BF16 run (and
    torch.load's weights_only) accepts."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {k: plain_tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_tensors(v) for v in state]
    if isinstance(state, DTensor):
        local = state._local_tensor
        if type(local) is not torch.Tensor and hasattr(local, "_tensor"):
            return DTensor.from_local(local._tensor, state.device_mesh, state.placements, run_check=False,
                                      shape=state.shape, stride=state.stride())
        return state
    if isinstance(state, torch.Tensor) and type(state) is not torch.Tensor and hasattr(state, "_tensor"):
        return state._tensor
    return state


def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU torch._scaled_mm accepts row-wise scales, which torchao's rowwise recipes call:
    torch 2.13 does; torch 2.11 asserts "only supports per-tensor scaling for CPU backend"."""
    a = torch.ones(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def check_float8_on_cpu(cfg: Float8Config) -> None:
    """A rowwise recipe on a host whose CPU torch._scaled_mm lacks row-wise scales: a ConfigError naming
    float8.recipe before anything is built, not torch's internal assert at the first FP8 GEMM."""
    if cfg.enable and cfg.recipe != "tensorwise" and not cpu_scaled_mm_takes_row_scales():
        raise ConfigError("float8.recipe", f"{cfg.recipe!r} needs torch._scaled_mm with row-wise scales, which torch "
                          f"{torch.__version__} lacks on CPU; use 'tensorwise' here (the routed experts' FP8 grouped "
                          "GEMM stays rowwise: the project emulates it on CPU) or torch >= 2.13")


def configure_inductor_for_float8(*, cfg: Float8Config) -> None:
    """Rowwise scaling under inductor needs emulated precision casts (pytorch#150859: NaNs otherwise)."""
    if cfg.enable and cfg.recipe != "tensorwise":
        torch._inductor.config.emulate_precision_casts = True


def param_precisions(model: nn.Module, *, param_dtype: str = "bfloat16") -> list[dict[str, str]]:
    """One row per parameter of `model` (names as model.named_parameters() gives them): its role and the precision
    its GEMM or op computes in, read from the module types the conversion left (Float8Linear, GroupedExperts.fp8,
    keep_fp32 blocks); `param_dtype` is what FSDP2 casts everything else to."""
    from torchtitan_glm.models.glm5.dsa import KPoolIndexer

    f8 = _try_float8_linear_class()
    roles = linear_roles(model)
    modules = dict(model.named_modules())
    expert_names = {n for n, _ in _expert_modules(model)}
    in_indexer = {f"{p}.{n}" if n else p for p, m in modules.items() if isinstance(m, KPoolIndexer)
                  for n, _ in m.named_modules()}
    low = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[param_dtype]
    rows = []
    for fqn, _ in model.named_parameters():
        owner_name, _, leaf = fqn.rpartition(".")
        owner = modules[owner_name]
        if owner_name in roles:
            role = roles[owner_name]
            precision = _float8_linear_precision(owner) if f8 is not None and isinstance(owner, f8) else low
        elif owner_name in expert_names:
            role, precision = "experts", ("fp8-grouped-rowwise" if owner.fp8 else low)
        else:
            role = _other_role(owner)
            if role == "norm" and owner_name in in_indexer:
                role = "indexer"  # the indexer's key LayerNorm
            precision = "fp32" if getattr(owner, "keep_fp32", False) else low
        rows.append({"fqn": fqn, "role": role, "precision": precision})
    return rows


def _try_float8_linear_class() -> type | None:
    try:
        return float8_linear_class()
    except ImportError:
        return None


def _float8_linear_precision(linear: nn.Module) -> str:
    from torchao.float8.config import ScalingGranularity

    granularity = linear.config.cast_config_weight.scaling_granularity
    return "fp8-tensorwise" if granularity is ScalingGranularity.TENSORWISE else "fp8-rowwise"


def _other_role(owner: nn.Module) -> str:
    """Role of a parameter outside Linears, experts and the indexer: the kind of block that declares it."""
    from torchtitan_glm.models.glm5 import dsa, kda, layers, mhc, moe

    kinds = ((mhc.HyperConnection, "mhc"), (mhc.LearnedHcHead, "mhc"), (moe.Router, "router"),
             (dsa.KPoolAPE, "kpool_ape"), (kda.KDADecay, "kda_decay"), (kda.ShortConv, "short_conv"),
             (layers.LMHead, "lm_head"), (nn.Embedding, "embedding"))
    for cls, role in kinds:
        if isinstance(owner, cls):
            return role
    return "norm"
