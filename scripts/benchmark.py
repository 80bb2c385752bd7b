"""Step time and peak memory of one training forward+backward, eager vs compiled, with and without activation
checkpointing, on one device; optionally swept over sequence lengths.

    python scripts/benchmark.py --flavor glm5_3_flash_proxy --seq-len 4096 --runs eager:none,compiled:none,eager:full,compiled:full
    python scripts/benchmark.py --seq-len sweep --runs compiled:auto      # T = 4K ... 128K, the AC each T needs

Weights are BF16, no FSDP, no optimizer; one row of `--docs` packed documents. `--scope train` is the trainer's
loss: fused CE + MTP layer + the indexer KL, over every visible pool (`--indexer-kl dense`, the default: the dense
warm-up's form and the sparse stage's with loss.indexer_sparse_loss = false; its dense attention target costs
O(T^2) FP32 work per DSA layer) or over the selected pools (`--indexer-kl sparse`, loss.indexer_sparse_loss = true:
linear in T). `--scope reference` drops the MTP
layer and the indexer KL, the scope of the transformers figure in shared/reference/measured_h200.md (trunk + LM
head + CE). AC `auto` picks selective up to T = 32K and full above. A run that runs out of memory prints a row
marked OOM and the sweep goes on. A third field `fp8` in a run (`compiled:selective:fp8`) converts the model to the
FP8 serving split first (`--float8-recipe`). `--profile` adds one profiled step per run and prints its CUDA kernels
by total time. Prints one JSON line per run and a markdown table; the proxy needs CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time

import torch

from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.compile import apply_compile
from torchtitan_glm.components.loss import indexer_kl_loss
from torchtitan_glm.components.metrics import flops_per_token
from torchtitan_glm.config import Float8Config
from torchtitan_glm.float8 import configure_inductor_for_float8, convert_float8
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor


SWEEP = (4096, 8192, 16384, 32768, 65536, 131072)


def auto_ac(seq_len: int) -> str:
    """Activation checkpointing for the proxy on one H200 (139 GiB): selective up to 32K tokens, full above."""
    return "selective" if seq_len <= 32768 else "full"


def run_one(*, flavor: str, seq_len: int, batch: int, compiled: bool, ac: str, steps: int, warmup: int,
            device: torch.device, dtype: torch.dtype, backend: str, scope: str, profile: bool, indexer_kl: str,
            docs: int, tile_elements: int, float8: str | None = None) -> dict:
    args = get_flavor(flavor).replace(indexer_tile_elements=tile_elements)
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
    doc_ids = (torch.arange(seq_len, device=device) * docs // seq_len).expand(batch, seq_len)
    labels[:, :-1].masked_fill_(doc_ids[:, 1:] != doc_ids[:, :-1], -100)
    n = labels.numel()

    def step() -> None:
        out = model(tokens, doc_ids=doc_ids, labels=labels, token_scale=1.0 / n,
                    mtp_scale=0.1 / n if train_scope else 0.0, indexer_kl=indexer_kl if train_scope else None)
        loss = (out.loss + indexer_kl_loss(out.indexer_stats)) if train_scope else out.loss
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
    result = dict(flavor=flavor, scope=scope, indexer_kl=indexer_kl if train_scope else None, seq_len=seq_len,
                  batch=batch, mode="compiled" if compiled else "eager", ac=ac, float8=float8 or "off",
                  step_ms=round(step_s * 1e3, 2), tokens_per_s=round(tps, 1), peak_mem_gib=round(peak, 2),
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
    p.add_argument("--seq-len", default="4096", help="T, comma-separated Ts, or 'sweep' (4K, 8K, ..., 128K)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--docs", type=int, default=1, help="documents packed in each row (equal lengths)")
    p.add_argument("--runs", default="eager:none,compiled:none,eager:full,compiled:full",
                   help="comma-separated mode:ac[:fp8] specs, mode in {eager, compiled}, ac in {none, full, selective, "
                        "auto}; a third field fp8 runs the FP8 serving split ([float8] defaults, --float8-recipe)")
    p.add_argument("--float8-recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--scope", choices=["train", "reference"], default="train")
    p.add_argument("--indexer-kl", choices=["sparse", "dense"], default="dense",
                   help="the trainer's default (loss.indexer_sparse_loss = false) is dense")
    p.add_argument("--indexer-tile-elements", type=int, default=0,
                   help="loss.indexer_tile_elements (default: 2^28 on CUDA, 2^26 on CPU)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default="")
    a = p.parse_args()
    seq_lens = SWEEP if a.seq_len == "sweep" else tuple(int(t) for t in a.seq_len.split(","))
    if not torch.cuda.is_available() and a.flavor != "debug":
        print(f"benchmark.py: flavor {a.flavor!r} needs a CUDA GPU and none is visible (the debug flavor runs on CPU).",
              file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tile_elements = a.indexer_tile_elements or (1 << 28 if device.type == "cuda" else 1 << 26)
    rows = []
    for seq_len in seq_lens:
        for spec in a.runs.split(","):
            mode, ac, *fp8 = spec.split(":")
            ac = auto_ac(seq_len) if ac == "auto" else ac
            try:
                r = run_one(flavor=a.flavor, seq_len=seq_len, batch=a.batch, compiled=mode == "compiled", ac=ac,
                            steps=a.steps, warmup=a.warmup, device=device, dtype=getattr(torch, a.dtype),
                            backend=a.backend, scope=a.scope, profile=a.profile, indexer_kl=a.indexer_kl, docs=a.docs,
                            tile_elements=tile_elements, float8=a.float8_recipe if fp8 == ["fp8"] else None)
            except torch.cuda.OutOfMemoryError as e:
                r = dict(flavor=a.flavor, scope=a.scope, seq_len=seq_len, mode=mode, ac=ac,
                         float8=a.float8_recipe if fp8 == ["fp8"] else "off", oom=str(e).split(".")[0])
            if "oom" in r:  # outside the handler: its traceback no longer holds the model
                gc.collect()
                torch.cuda.empty_cache()
                torch._dynamo.reset()
            print(json.dumps(r), flush=True)
            rows.append(r)
            if a.out:  # after every run, so a run cut off by a time limit keeps the ones before it
                with open(a.out, "w") as f:
                    json.dump(rows, f, indent=1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{name}, torch {torch.__version__}\n")
    kl = f", indexer KL {a.indexer_kl}, indexer tiles of {tile_elements} elements" if a.scope == "train" else ""
    print(f"scope: {a.scope}{kl}, {a.docs} document(s) per row\n")
    print("| T | mode | AC | float8 | step ms | tokens/s | TFLOP/s | peak GiB | warm-up s |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "oom" in r:
            print(f"| {r['seq_len']:,} | {r['mode']} | {r['ac']} | {r['float8']} | OOM | | | | |")
            continue
        print(f"| {r['seq_len']:,} | {r['mode']} | {r['ac']} | {r['float8']} | {r['step_ms']} | "
              f"{r['tokens_per_s']:,.0f} | {r['tflops']} | {r['peak_mem_gib']} | {r['warmup_s']} |")


if __name__ == "__main__":
    main()
