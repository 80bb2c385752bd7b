"""Step time and peak memory of one training forward+backward, eager vs compiled, with and without activation
checkpointing, on one device.

    python scripts/benchmark.py --flavor glm5_3_flash_proxy --seq-len 4096 --runs eager:none,compiled:none,eager:full,compiled:full

Weights are BF16, no FSDP, no optimizer. `--scope train` is the trainer's loss (fused CE + MTP layer + indexer
KL over all visible pools, the dense-warm-up form; the sparse stage only masks it further); `--scope reference` drops the MTP layer and the indexer KL, the scope of the transformers figure in
shared/reference/measured_h200.md (trunk + LM head + CE). `--profile` adds one profiled step per run and prints
its CUDA kernels by total time. Prints one JSON line per run and a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time

import torch

from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.compile import apply_compile
from torchtitan_glm.components.loss import indexer_kl_loss
from torchtitan_glm.components.metrics import flops_per_token
from torchtitan_glm.config import Float8Config
from torchtitan_glm.float8 import configure_inductor_for_float8, convert_float8
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor


def run_one(*, flavor: str, seq_len: int, batch: int, compiled: bool, ac: str, steps: int, warmup: int,
            device: torch.device, dtype: torch.dtype, backend: str, scope: str, profile: bool,
            float8: str | None = None) -> dict:
    args = get_flavor(flavor)
    train_scope = scope == "train"
    if not train_scope:
        args = dataclasses.replace(args, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Glm5Model(args)
    model.to_empty(device=device)
    model.init_weights()
    model.to(dtype)
    f8 = Float8Config(enable=float8 is not None, recipe=float8 or "tensorwise")
    convert_float8(model, cfg=f8)  # the serving split, exactly as the trainer converts
    configure_inductor_for_float8(cfg=f8)
    apply_activation_checkpointing(model, mode=ac)
    if compiled:
        apply_compile(model, backend=backend, components=["model", "loss"])
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len), device=device)
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    doc_ids = torch.zeros_like(tokens)
    n = labels.numel()

    def step() -> None:
        out = model(tokens, doc_ids=doc_ids, labels=labels, token_scale=1.0 / n,
                    mtp_scale=0.1 / n if train_scope else 0.0, collect_indexer_stats=train_scope)
        loss = (out.loss + indexer_kl_loss(out.indexer_stats, sparse=False)) if train_scope else out.loss
        loss.backward()
        for p in model.parameters():
            p.grad = None

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    if profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            step()
            sync()
        sort_by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=60), flush=True)
    tps = batch * seq_len / step_s
    result = dict(flavor=flavor, scope=scope, seq_len=seq_len, batch=batch, mode="compiled" if compiled else "eager",
                  ac=ac, float8=float8 or "off", step_ms=round(step_s * 1e3, 2), tokens_per_s=round(tps, 1), peak_mem_gib=round(peak, 2),
                  warmup_s=round(warmup_s, 1), tflops=round(tps * flops_per_token(args, seq_len) / 1e12, 1))
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="glm5_3_flash_proxy")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--runs", default="eager:none,compiled:none,eager:full,compiled:full",
                   help="comma-separated mode:ac[:fp8] specs, mode in {eager, compiled}, ac in {none, full, selective}; "
                        "a third field fp8 runs the FP8 serving split ([float8] defaults, --float8-recipe)")
    p.add_argument("--float8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--scope", choices=["train", "reference"], default="train")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default="")
    a = p.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for spec in a.runs.split(","):
        mode, ac, *fp8 = spec.split(":")
        r = run_one(flavor=a.flavor, seq_len=a.seq_len, batch=a.batch, compiled=mode == "compiled", ac=ac,
                    steps=a.steps, warmup=a.warmup, device=device, dtype=getattr(torch, a.dtype), backend=a.backend,
                    scope=a.scope, profile=a.profile, float8=a.float8_recipe if fp8 == ["fp8"] else None)
        print(json.dumps(r), flush=True)
        rows.append(r)
        if a.out:  # after every run, so a run cut off by a time limit keeps the ones before it
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}\n")
    print(f"scope: {a.scope}\n")
    print("| mode | AC | float8 | step ms | tokens/s | TFLOP/s | peak GiB | warm-up s |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ac']} | {r['float8']} | {r['step_ms']} | {r['tokens_per_s']:,.0f} | {r['tflops']} | "
              f"{r['peak_mem_gib']} | {r['warmup_s']} |")


if __name__ == "__main__":
    main()
