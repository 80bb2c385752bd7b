"""The optimizer step alone on one GPU, over the trainable parameters a config's model has: each [optimizer]
name:implementation, CUDA events, median of --steps after --warmup (the first steps create the states and, for
torchao's compiled step, compile one graph per parameter shape).

    python scripts/bench_optim.py                                     # the proxy's parameters, FP32 as FSDP2 keeps them
    python scripts/bench_optim.py --max-elements 2e9 --optimizers AdamW8bit:fused,AdamW8bit:compiled

The parameters are those of `--config`'s model (built on the meta device, as the planner builds it), taken in
model order up to --max-elements (default: all; the proxy has 7.95e9, whose FP32 parameters and gradients take
64 GB, so an 80 GB card needs a cap), allocated as plain CUDA tensors with fixed random gradients. The step is the
same per element whatever the cap, apart from launches: the table gives ms per step, ps per element, and the
bandwidth that ms means at 16 B per element (read p, g and both 1-byte moments, write p and both moments; AdamW's
FP32 moments: 28 B). For AdamW8bit's fused step more rows time its kernel alone with the 8-bit codes found each
way ops/adamw_lowbit_triton.py has (CODE_SEARCHES) and launch shape (the step runs the default, "approx").
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

from cuda_timing import at_least, median_ms, print_table

_BYTES = {"AdamW": 28, "AdamW8bit": 16, "AdamWFp8": 16}
_SHAPES = ((8, 4), (4, 4), (2, 4), (1, 4), (1, 2), (2, 8))  # the kernel-alone rows' (blocks per program, warps)


class _Holder(nn.Module):
    """The chosen parameters under one module, so build_optimizer groups them as train.py does (ndim < 2 undecayed)."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(t) for t in tensors)


def model_shapes(config: str, overrides: list[str]) -> list[torch.Size]:
    from torchtitan_glm.config import load_config
    from torchtitan_glm.planner.model import build_meta_model

    cfg = load_config(["--config", config, *overrides])
    model, _ = build_meta_model(cfg)
    return [p.shape for p in model.parameters() if p.requires_grad]


def run(name: str, impl: str, shapes: list[torch.Size], *, steps: int, warmup: int,
        kernel_rows: list[tuple[str, int, int]]) -> list[dict]:
    from torchtitan_glm.components.optimizer import build_optimizer
    from torchtitan_glm.config import OptimizerConfig

    gen = torch.Generator(device="cuda").manual_seed(0)
    holder = _Holder([torch.randn(s, device="cuda", generator=gen) * 0.02 for s in shapes])
    for p in holder.parameters():
        p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
    opt = build_optimizer(model=holder, cfg=OptimizerConfig(name=name, implementation=impl))
    elements = sum(p.numel() for p in holder.parameters())

    def row(label: str, ms: float) -> dict:
        return dict(optimizer=label, tensors=len(shapes), elements=elements, step_ms=round(ms, 3),
                    ps_per_element=round(ms * 1e9 / elements, 2),
                    gb_per_s=round(elements * _BYTES[name] / (ms * 1e-3) / 1e9, 1),
                    peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))

    rows = [row(f"{name}:{getattr(opt, 'implementation', impl)}", median_ms(opt.step, steps=steps, warmup=warmup))]
    if name == "AdamW8bit" and opt.implementation == "fused":
        # the kernel alone over the states the steps made, its 8-bit codes found each way and launch shape
        # (256-value blocks per program, warps)
        for how, r, w in kernel_rows:
            step_all = _kernels(opt, how, rows=r, num_warps=w)
            ms = median_ms(step_all, steps=steps, warmup=1)
            k = step_all()
            regs = f", {k.n_regs} registers, {k.n_spills} spills" if k is not None else ", no 8-bit states"
            rows.append(row(f"{name} kernel alone, codes {how}, {r} blocks/{w} warps{regs}", ms))
    del opt, holder
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return rows


def _kernels(opt, codes: str, **launch):
    """A closure stepping every parameter through ops/adamw_lowbit_triton.py directly (no optimizer around it)."""
    from torchtitan_glm.components.lowbit_step import state_format
    from torchtitan_glm.ops.adamw_lowbit import DYNAMIC8, state_parts
    from torchtitan_glm.ops.adamw_lowbit_triton import adamw_lowbit_kernel_

    calls = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            fmt = state_format(st["exp_avg"])
            calls.append((p.detach(), p.grad, *state_parts(st["exp_avg"], fmt), *state_parts(st["exp_avg_sq"], fmt),
                          st["step"], fmt, group))

    def run():
        kernels = {}
        for p, g, *parts, step, fmt, group in calls:
            kernels[fmt] = adamw_lowbit_kernel_(p, g, *parts, step, None, fmt=fmt, lr=1e-4, lr_wd=1e-5,
                                                beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                                                codes=codes, **launch)
        return kernels.get(DYNAMIC8)  # the 8-bit states' compiled kernel (None: every state plain)
    return run


def main() -> int:
    from torchtitan_glm.components.logs import drop_benign_warnings

    drop_benign_warnings()  # before torchao is imported (its import warns)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="train_configs/glm5_3_flash_proxy.toml")
    p.add_argument("--optimizers", default="AdamW8bit:fused,AdamW8bit:compiled,AdamWFp8:fused,AdamWFp8:compiled",
                   help="comma-separated name:implementation ([optimizer] name and implementation)")
    p.add_argument("--max-elements", type=float, default=None, help="cap on the parameters' elements (model order)")
    p.add_argument("--steps", type=at_least(1), default=10)
    p.add_argument("--warmup", type=at_least(1), default=3, help=">= 1: the first step creates the states")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--kernel-rows", default="all",
                   help="AdamW8bit:fused's kernel-alone rows: comma-separated codes:blocks x warps (e.g. "
                        "checked:1x2,search:8x4), 'all' (every code search at each of "
                        + " ".join(f"{r}x{w}" for r, w in _SHAPES) + ") or 'none'")
    a, overrides = p.parse_known_args()  # the rest: config overrides, e.g. --training.seq_len 8192
    from torchtitan_glm.config import ConfigError, OptimizerConfig
    from torchtitan_glm.ops.adamw_lowbit import CODE_SEARCHES

    if a.kernel_rows == "all":
        kernel_rows = [(how, r, w) for how in CODE_SEARCHES for r, w in _SHAPES]
    elif a.kernel_rows == "none":
        kernel_rows = []
    else:
        kernel_rows = []
        for item in a.kernel_rows.split(","):
            how, _, shape = item.partition(":")
            r, _, w = shape.partition("x")
            if how not in CODE_SEARCHES or not (r.isdigit() and w.isdigit()) or int(r) < 1 or int(w) < 1:
                print(f"--kernel-rows {item!r}: want codes:blocks x warps, codes one of {CODE_SEARCHES}",
                      file=sys.stderr)
                return 2
            kernel_rows.append((how, int(r), int(w)))
    if not torch.cuda.is_available():  # after the flags: a typo is caught before a GPU is paid for
        print("bench_optim.py times CUDA kernels: needs CUDA", file=sys.stderr)
        return 2

    choices = []
    for item in a.optimizers.split(","):
        name, _, impl = item.partition(":")
        try:
            OptimizerConfig(name=name, implementation=impl or "auto").validate()
        except ConfigError as e:
            print(f"--optimizers {item!r}: {e}", file=sys.stderr)
            return 2
        choices.append((name, impl or "auto"))
    shapes, total = [], 0
    for s in model_shapes(a.config, overrides):
        n = s.numel()
        if a.max_elements is not None and total + n > a.max_elements:
            continue
        shapes.append(s)
        total += n
    if not shapes:
        print(f"--max-elements {a.max_elements:g} admits no parameter of {a.config}", file=sys.stderr)
        return 2
    rows = []
    for name, impl in choices:
        for row in run(name, impl, shapes, steps=a.steps, warmup=a.warmup, kernel_rows=kernel_rows):
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {a.config}: {len(shapes)} tensors, "
                f"{total / 1e9:.2f}e9 elements, FP32",
                {"optimizer": "optimizer", "step ms": "step_ms", "ps per element": "ps_per_element",
                 "GB/s at its bytes per element": "gb_per_s", "peak GiB": "peak_gib"}, rows, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
