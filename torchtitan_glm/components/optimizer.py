"""AdamW (torch's, or torchao's low-bit AdamW8bit / AdamWFp8) with weight-decay exclusions declared by the model,
its state's size per rank, and DTensor-aware global-norm gradient clipping.

No decay for: every parameter with ndim < 2 (norm weights, biases, A_log, dt_bias, mHC base/scale), every parameter
of a module whose class sets `no_weight_decay = True`, and every parameter named in its module's
`no_weight_decay_params` set (e.g. KPool APE, mHC fn). Blocks declare this themselves; nothing matches on names.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from torchtitan_glm.config import OptimizerConfig

__all__ = ["split_decay_params", "param_groups", "resolved_implementation", "build_optimizer", "optimizer_state_bytes",
           "adamw_state_bytes", "clip_grad_norm_"]

# torchao.optim's low-bit AdamW: tensors of at least this many values, in blocks of this many (one FP32 scale per
# block), are stored quantised (1 byte a value; AdamW8bit adds a 256-entry FP32 code map per state); smaller ones
# keep states in the parameter's dtype.
_LOW_BIT_MIN_NUMEL, _LOW_BIT_BLOCK, _QMAP_BYTES = 4096, 256, 256 * 4


def split_decay_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(decayed, not decayed) trainable (fqn, parameter) pairs; a parameter shared by several modules is listed
    once, and is not decayed if any owner excludes it."""
    owners_exclude: dict[int, bool] = {}
    names: dict[int, tuple[str, nn.Parameter]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        whole = bool(getattr(type(module), "no_weight_decay", False))
        listed = set(getattr(module, "no_weight_decay_params", ()) or ())
        unknown = listed - set(n for n, _ in module.named_parameters(recurse=False))
        if unknown:
            raise ValueError(f"{type(module).__name__} at {mod_name or '<root>'} lists no_weight_decay_params "
                             f"{sorted(unknown)} that are not its own parameters")
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            exclude = whole or p_name in listed or p.ndim < 2
            names.setdefault(id(p), (f"{mod_name}.{p_name}" if mod_name else p_name, p))
            owners_exclude[id(p)] = owners_exclude.get(id(p), False) or exclude
    decay = [names[k] for k, ex in owners_exclude.items() if not ex]
    no_decay = [names[k] for k, ex in owners_exclude.items() if ex]
    return decay, no_decay


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Optimizer param groups: decayed parameters with `weight_decay`, the rest with 0 (empty groups dropped)."""
    from torch.distributed.tensor import DTensor

    decay, no_decay = split_decay_params(model)
    groups = []
    # FSDP2-sharded (DTensor) and replicated plain parameters go to separate groups: foreach/fused kernels
    # cannot mix the two kinds in one call.
    for params, wd in ((decay, weight_decay), (no_decay, 0.0)):
        for sharded in (True, False):
            chosen = [p for _, p in params if isinstance(p, DTensor) == sharded]
            if chosen:
                groups.append({"params": chosen, "weight_decay": wd})
    return groups


def resolved_implementation(cfg: OptimizerConfig, *, on_cuda: bool) -> str:
    """The step `build_optimizer` runs for [optimizer] over parameters on CUDA or not: AdamW "auto" is "fused" on
    CUDA, else "foreach"; the low-bit AdamWs' "auto" is the project's "fused" step everywhere (on CUDA faster than
    torchao's compiled step for both, as measured in docs/performance.md, sixteenth session; on CPU it is the torch
    reference, with no compile to pay)."""
    if cfg.implementation != "auto":
        return cfg.implementation
    if cfg.name == "AdamW":
        return "fused" if on_cuda else "foreach"
    return "fused"


def build_optimizer(*, model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The [optimizer] over `param_groups`: torch's AdamW or torchao's AdamW8bit / AdamWFp8, stepped by
    `resolved_implementation` (for the low-bit ones "fused" is ops/adamw_lowbit.py, "compiled" torchao's own step)."""
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        raise ValueError("model has no trainable parameters")
    hyper = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    on_cuda = any(p.device.type == "cuda" for g in groups for p in g["params"])
    impl = resolved_implementation(cfg, on_cuda=on_cuda)
    if cfg.name != "AdamW":
        return _low_bit(cfg.name, groups, on_cuda=on_cuda, implementation=impl, **hyper)
    flags = {"fused": dict(fused=True, foreach=False), "foreach": dict(fused=False, foreach=True),
             "for-loop": dict(fused=False, foreach=False)}
    if impl not in flags:
        raise ValueError(f"unknown optimizer.implementation {cfg.implementation!r}")
    return torch.optim.AdamW(groups, **hyper, **flags[impl])


def _low_bit(name: str, groups: list[dict], *, on_cuda: bool, implementation: str,
             **hyper) -> torch.optim.Optimizer:
    from torchtitan_glm.config import ConfigError

    try:
        from torchao.optim import AdamW8bit, AdamWFp8
    except ImportError as e:  # pragma: no cover - torchao is a dependency
        raise ConfigError("optimizer.name", f"{name} needs torchao.optim ({e})") from e
    if name == "AdamWFp8" and on_cuda and torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError("optimizer.name", "AdamWFp8 needs a GPU of compute capability >= 8.9 (FP8 E4M3); this "
                          f"one is {torch.cuda.get_device_name()}: use AdamW8bit")
    fused = implementation == "fused"
    base = {"AdamW8bit": AdamW8bit, "AdamWFp8": AdamWFp8}[name]

    class LowBitAdamW(base):  # type: ignore[misc, valid-type]
        """torchao's optimizer and states. Stepped by ops/adamw_lowbit.py (components/lowbit_step.py; "fused") or by
        torchao's per-parameter compiled step ("compiled"), the latter without AOTAutograd's on-disk cache: with
        torch 2.13 and torchao 0.18 that cache served AdamW8bit's compiled step to AdamWFp8 (same graph, other state
        class; "'OptimStateFp8' object has no attribute 'qmap'") once both had run on a machine."""

        implementation = "fused" if fused else "compiled"
        # the fused step honours a device-side found_inf flag (components/step_stats.py::optimizer_step)
        supports_found_inf = fused

        def step(self, closure=None):
            if self.implementation == "fused":
                from torchtitan_glm.components.lowbit_step import fused_lowbit_step

                loss = None
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
                fused_lowbit_step(self, getattr(self, "found_inf", None))
                return loss
            functorch_config = torch._functorch.config
            if not hasattr(functorch_config, "enable_autograd_cache"):
                return super().step(closure)
            with functorch_config.patch(enable_autograd_cache=False):
                return super().step(closure)

    LowBitAdamW.__name__ = LowBitAdamW.__qualname__ = name
    return LowBitAdamW(groups, **hyper)


def optimizer_state_bytes(model: nn.Module, cfg: OptimizerConfig) -> int:
    """Bytes of this rank's optimizer states (both AdamW moments; the step counters are negligible), from the
    local shards of the trainable parameters, as `build_optimizer`'s choice stores them."""
    from torchtitan_glm.components.logs import local_shard

    total = 0
    for p in model.parameters():
        if p.requires_grad:
            local = local_shard(p)
            total += adamw_state_bytes(local.numel(), local.element_size(), cfg.name)
    return total


def adamw_state_bytes(numel: int, element_size: int, name: str) -> int:
    """Bytes of both AdamW moments of one local parameter of `numel` elements under optimizer `name` (the
    planner counts with the same rule)."""
    if name != "AdamW" and numel >= _LOW_BIT_MIN_NUMEL and numel % _LOW_BIT_BLOCK == 0:
        return 2 * (numel + 4 * numel // _LOW_BIT_BLOCK + (_QMAP_BYTES if name == "AdamW8bit" else 0))
    return 2 * numel * element_size


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, *, norm_type: float = 2.0,
                    foreach: bool | None = None, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients in place so their global `norm_type` norm is at most `max_norm`; return that norm (before
    clipping) as a plain, replicated tensor.

    Gradients may be DTensors (FSDP2, possibly on different meshes or placements, e.g. experts vs dense): the
    norm of each group sharing a (mesh, placements) is reduced with full_tensor(), then the group norms combine.
    """
    from torch.distributed.tensor import DTensor

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else (None, g.device)
        groups.setdefault(key, []).append(p)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, error_if_nonfinite=False,
                                          foreach=foreach)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    device = norms[0].device
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(
        torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm ({norm_type}) is non-finite: {total.item()}")
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device), foreach=foreach)
    return total
