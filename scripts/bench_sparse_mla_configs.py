"""The sparse MLA backward's Triton configs one by one on a GPU: each checked against the torch reference at a short
T, then timed at a long one (ops/sparse_mla_triton.py keeps the list it autotunes over; this is how it was chosen).

    python scripts/bench_sparse_mla_configs.py                                   # the kernel's own configs
    python scripts/bench_sparse_mla_configs.py --configs "64,32,8,2;32,16,8,1" --seq-len 32768

A config is BLOCK_H,BLOCK_K,num_warps,num_stages. Each runs in its own process: a kernel that faults leaves the CUDA
context unusable, and the others must still run. Configs the kernel refuses (ops/sparse_mla_triton.py::
_bwd_config_faults) are reported as refused. GLM-5.3-Flash's shapes: 64 heads, latent 512, K = 2,051, BF16; the
selection is random and causal (scripts/bench_dsa.py::causal_selection). Prints one JSON line per config and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from cuda_timing import at_least, kernel_configs

H, D = 64, 512


def run_one(cfg: tuple[int, int, int, int], *, seqlen: int, check_len: int, k: int, steps: int) -> dict:
    from bench_dsa import causal_selection
    from cuda_timing import median_ms

    from torchtitan_glm.ops.sparse_mla import sparse_mla_reference, sparse_mla_reference_bwd
    from torchtitan_glm.ops.sparse_mla_triton import sparse_mla_bwd_triton, sparse_mla_fwd_triton

    config = dict(zip(("BLOCK_H", "BLOCK_K", "num_warps", "num_stages"), cfg))
    scale = 256**-0.5
    row: dict = dict(config=list(cfg), seq_len=seqlen, k=k)

    def inputs(t: int):
        gen = torch.Generator(device="cuda").manual_seed(t)
        q = torch.randn(1, t, H, D, generator=gen, device="cuda").bfloat16()
        kv = torch.randn(1, t, D, generator=gen, device="cuda").bfloat16()
        idx = causal_selection(t, k, "cuda")
        out, lse = sparse_mla_fwd_triton(q, kv, idx, scale=scale)
        return q, kv, idx, out, lse, torch.randn_like(out)

    q, kv, idx, out, lse, dout = inputs(check_len)
    try:
        dq, dkv = sparse_mla_bwd_triton(dout, q, kv, idx, out, lse, scale=scale, config=config)
    except ValueError as e:
        return dict(row, refused=str(e))
    ref_dq, ref_dkv = sparse_mla_reference_bwd(dout, q, kv, idx, *sparse_mla_reference(q, kv, idx, scale=scale),
                                               scale=scale)

    def rms(a, b):
        return ((a.float() - b.float()).square().mean().sqrt() / b.float().square().mean().sqrt()).item()

    row.update(dq_rms_vs_reference=rms(dq, ref_dq), dkv_rms_vs_reference=rms(dkv, ref_dkv))
    del q, kv, idx, out, lse, dout, dq, dkv
    q, kv, idx, out, lse, dout = inputs(seqlen)
    row["bwd_ms"] = round(median_ms(
        lambda: sparse_mla_bwd_triton(dout, q, kv, idx, out, lse, scale=scale, config=config),
        steps=steps, warmup=2), 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=kernel_configs, default=None,
                   help="';'-separated BLOCK_H,BLOCK_K,num_warps,num_stages (default: the kernel's autotuning list)")
    p.add_argument("--seq-len", type=at_least(1), default=32768, help="T of the timing")
    p.add_argument("--check-seq-len", type=at_least(1), default=2048, help="T of the check against the reference")
    p.add_argument("--k", type=at_least(1), default=2051)
    p.add_argument("--steps", type=at_least(1), default=10)
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # a child process: run this config only
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_sparse_mla_configs.py: needs a CUDA GPU; none is visible.", file=sys.stderr)
        sys.exit(2)
    if a.one:
        cfg = tuple(int(x) for x in a.one.split(","))
        print("ROW " + json.dumps(run_one(cfg, seqlen=a.seq_len, check_len=a.check_seq_len, k=a.k, steps=a.steps)))
        return
    from torchtitan_glm.ops.sparse_mla_triton import BWD_CONFIGS

    configs = a.configs or BWD_CONFIGS
    rows = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")]))
    for cfg in configs:
        args = [sys.executable, os.path.abspath(__file__), "--one", ",".join(map(str, cfg)), "--seq-len",
                str(a.seq_len), "--check-seq-len", str(a.check_seq_len), "--k", str(a.k), "--steps", str(a.steps)]
        res = subprocess.run(args, capture_output=True, text=True, env=env)
        lines = [x for x in res.stdout.splitlines() if x.startswith("ROW ")]
        row = json.loads(lines[0][4:]) if lines else dict(
            config=list(cfg), seq_len=a.seq_len, k=a.k,
            failed=(res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1][:300])
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, H = {H}, D = {D}, K = {a.k}\n")
    print(f"| config (BLOCK_H, BLOCK_K, warps, stages) | backward ms at T = {a.seq_len:,} | dq / dkv RMS vs reference "
          f"(T = {a.check_seq_len:,}) |\n|---|---|---|")
    for r in rows:
        if "bwd_ms" in r:
            print(f"| {tuple(r['config'])} | {r['bwd_ms']} | {r['dq_rms_vs_reference']:.1e} / "
                  f"{r['dkv_rms_vs_reference']:.1e} |")
        else:
            print(f"| {tuple(r['config'])} | {'refused' if 'refused' in r else 'failed'}: "
                  f"{r.get('refused', r.get('failed'))} | |")


if __name__ == "__main__":
    main()
