"""One KDA block, forward + backward, on one GPU: ours (models/glm5/kda.py: projections, short convs, decay gate, the
FLA chunk kernel behind our custom op, gated norm, output projection), eager and compiled with inductor, against
FLA's stock `fla.layers.KimiDeltaAttention` built with the same shapes (issue 12's target: ours compiled >= 1.2x).

    python scripts/bench_kda.py                                   # T = 8192, the flavor's KDA shapes, BF16
    python scripts/bench_kda.py --seq-len 4096,8192 --flavor glm5_3_flash_proxy --json kda.json

Both layers take BF16 parameters and a [1, T, hidden] BF16 input (one document), safe gate with the flavor's lower
bound, and are timed with CUDA events (median of --steps after --warmup; the first calls autotune FLA's kernels and
compile ours). Prints one JSON line per variant and a markdown table with the ratio to FLA's layer.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from cuda_timing import median_ms


def our_block(flavor: str, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, object]:
    from torchtitan_glm.models.glm5 import get_flavor
    from torchtitan_glm.models.glm5.kda import KimiDeltaAttention

    args = get_flavor(flavor)
    with torch.device("meta"):
        block = KimiDeltaAttention(args)
    block.to_empty(device=device)
    block.init_weights()
    return block.to(dtype), args


def fla_block(args, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from fla.layers import KimiDeltaAttention as FLAKimiDeltaAttention

    lb = args.linear_lower_bound
    return FLAKimiDeltaAttention(
        hidden_size=args.hidden_size, head_dim=args.linear_head_dim, num_heads=args.linear_num_heads, mode="chunk",
        use_short_conv=True, conv_size=args.linear_conv_kernel_dim, safe_gate=lb is not None, lower_bound=lb,
        norm_eps=args.rms_norm_eps,
    ).to(device=device, dtype=dtype)


def fwd_bwd(call, params: list[torch.nn.Parameter], x: torch.Tensor, dout: torch.Tensor):
    def run():
        out = call(x)
        out.backward(dout)
        x.grad = None
        for p in params:
            p.grad = None
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="glm5_3_flash_proxy")
    p.add_argument("--seq-len", default="8192", help="comma-separated Ts")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_kda.py times CUDA kernels (FLA's layer needs CUDA)", file=sys.stderr)
        return 2
    from torchtitan_glm.models.glm5.batch import batch_layout

    dtype, device = torch.bfloat16, "cuda"
    ours, args = our_block(a.flavor, device, dtype)
    stock = fla_block(args, device, dtype)
    compiled = torch.compile(ours, fullgraph=True, backend="inductor")
    rows = []
    for seq_len in (int(t) for t in a.seq_len.split(",")):
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(1, seq_len, args.hidden_size, device=device, dtype=dtype, generator=gen).requires_grad_()
        dout = torch.randn(1, seq_len, args.hidden_size, device=device, dtype=dtype, generator=gen)
        layout = batch_layout(None, (1, seq_len), torch.device(device))
        variants = {
            "FLA KimiDeltaAttention (stock layer)": fwd_bwd(lambda t: stock(t)[0], list(stock.parameters()), x, dout),
            "ours, eager": fwd_bwd(lambda t: ours(t, layout), list(ours.parameters()), x, dout),
            "ours, compiled (inductor)": fwd_bwd(lambda t: compiled(t, layout), list(ours.parameters()), x, dout),
        }
        base = None
        for name, fn in variants.items():
            torch.cuda.reset_peak_memory_stats()
            ms = median_ms(fn, steps=a.steps, warmup=a.warmup)
            base = base or ms
            row = dict(seq_len=seq_len, variant=name, fwd_bwd_ms=round(ms, 3), speedup_vs_fla=round(base / ms, 3),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, flavor {a.flavor} "
          f"(hidden {args.hidden_size}, {args.linear_num_heads} heads x {args.linear_head_dim}), BF16\n")
    print("| T | variant | fwd+bwd ms | vs FLA's layer | peak GiB |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq_len']} | {r['variant']} | {r['fwd_bwd_ms']} | {r['speedup_vs_fla']}x | {r['peak_gib']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
