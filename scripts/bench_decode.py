"""Decode throughput: prefill a batch of prompts, then time one-token decode steps (models/glm5/decode.py).

    python scripts/bench_decode.py [--flavor glm5_3_flash_proxy | --hf DIR] [--batch 1,64] [--prompt-len 512]
        [--steps 64] [--warmup 4] [--json OUT]

Per batch size: prefill seconds, decode milliseconds per step and tokens/s (batch x steps / time; eager PyTorch, one
step = one Python pass over the layers), peak GPU memory. Random token prompts, seeded random init (or --hf).
On CPU a seeded flavor is refused before it is built when its FP32 parameters (init runs in FP32, then the cast
to --dtype) would take over half the host's available memory (MemAvailable), e.g. the ~7B proxy: use --flavor debug.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cuda_timing, when loaded by path

from cuda_timing import at_least, int_list  # noqa: E402

from torchtitan_glm.components.logs import host_available_memory  # noqa: E402
from torchtitan_glm.models.glm5 import Glm5Model, from_pretrained, get_flavor  # noqa: E402
from torchtitan_glm.models.glm5.decode import decode_step, prefill  # noqa: E402
from torchtitan_glm.models.glm5.hf_io import _cast_for_load  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def bench(model: Glm5Model, *, batch: int, prompt_len: int, steps: int, warmup: int, device: torch.device) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(batch)
    tokens = torch.randint(0, model.args.vocab_size, (batch, prompt_len), generator=gen).to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    start = time.perf_counter()
    hidden, state = prefill(model, tokens, capacity=prompt_len + warmup + steps + 1)
    nxt = model.lm_head(hidden[:, -1]).argmax(-1)
    _sync(device)
    prefill_s = time.perf_counter() - start
    for _ in range(warmup):
        nxt = model.lm_head(decode_step(model, nxt, state)).argmax(-1)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        nxt = model.lm_head(decode_step(model, nxt, state)).argmax(-1)
    _sync(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"batch": batch, "prompt_len": prompt_len, "steps": steps, "prefill_s": prefill_s,
            "ms_per_step": 1e3 * seconds / steps, "tokens_per_s": batch * steps / seconds, "peak_gib": peak}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="glm5_3_flash_proxy")
    p.add_argument("--hf", default=None)
    p.add_argument("--batch", type=int_list(), default=(1, 64), help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=at_least(1), default=512)
    p.add_argument("--steps", type=at_least(1), default=64)
    p.add_argument("--warmup", type=at_least(0), default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    batches = list(a.batch)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device is visible (use --device cpu)")
    if a.hf and not os.path.exists(a.hf):
        p.error(f"--hf {a.hf} does not exist")
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.manual_seed(0)
    if a.hf:
        try:
            model = from_pretrained(a.hf, dtype=dtype, device=device, keep_extra_tensors=False)
        except OSError as e:  # no config.json / safetensors, named by the loader
            p.error(f"--hf: cannot load {a.hf}: {e}")
    else:
        try:
            args = get_flavor(a.flavor).replace(num_nextn_predict_layers=0)
        except ValueError as e:
            p.error(f"--flavor: {e}")
        with torch.device("meta"):
            model = Glm5Model(args)
        available = host_available_memory() if device.type == "cpu" else None
        need = 4 * sum(t.numel() for t in model.parameters())  # init_weights runs in FP32
        if available is not None and need > available / 2:
            p.error(f"--flavor {a.flavor}: {need / 4e9:.1f}B parameters need {need / 2**30:.1f} GiB in FP32 on the "
                    f"CPU, over half the {available / 2**30:.1f} GiB available; use --flavor debug (or a GPU)")
        model.to_empty(device=device)
        model.init_weights()
        _cast_for_load(model, dtype)
    model.eval()
    rows = []
    for b in batches:
        r = bench(model, batch=b, prompt_len=a.prompt_len, steps=a.steps, warmup=a.warmup, device=device)
        rows.append(r)
        peak = f", peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""
        print(f"{a.hf or a.flavor} {a.dtype} batch {b:4d}, prompt {a.prompt_len}: prefill {r['prefill_s']:.2f}s, "
              f"decode {r['ms_per_step']:.1f} ms/step = {r['tokens_per_s']:.0f} tokens/s{peak}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.hf or a.flavor, "device": str(device) if device.type != "cuda" else
                       torch.cuda.get_device_name(device), "dtype": a.dtype, "runs": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
