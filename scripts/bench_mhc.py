"""One mHC site, forward + backward, compiled with inductor, on one GPU: the maps (models/glm5/mhc.py::
HyperConnection: RMS-scaled FP32 projection, sigmoids, Sinkhorn, the collapsed input) and the merge of the block's
output into the streams, with the streams' mixing comb^T x as a batched matmul (what eager runs, and what compiled
runs before the eleventh session) and as the n-term sum `mix_streams` writes out under compile.

    python scripts/bench_mhc.py                       # T = 4096, the proxy's widths (hc_mult 4, hidden 4096), BF16
    python scripts/bench_mhc.py --seq-len 4096,32768

CUDA events, median of --steps after --warmup; one JSON line per variant, then a markdown table. Every decoder
layer has two sites, so a step of the proxy runs 2 x 8 of them (plus the MTP layer's none).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from cuda_timing import at_least, backward_step, int_list, median_ms


def merge_bmm(residual, block_out, post, comb):
    """The merge with the mixing as one batched matmul (eager's form)."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), residual)


def variants(seq_len: int, device: str, dtype: torch.dtype, *, flavor: str = "glm5_3_flash_proxy",
             backend: str = "inductor") -> dict:
    """{name: fwd+bwd closure}: the merge alone in both forms, and the whole site (maps + merge) in both forms."""
    from torchtitan_glm.models.glm5 import get_flavor
    from torchtitan_glm.models.glm5.mhc import HyperConnection

    args = get_flavor(flavor)
    n, d = args.hc_mult, args.hidden_size
    hc = HyperConnection(hidden_size=d, hc_mult=n, sinkhorn_iters=args.hc_sinkhorn_iters, hc_eps=args.hc_eps,
                         norm_eps=args.rms_norm_eps).to(device)
    hc.init_weights()
    gen = torch.Generator(device=device).manual_seed(0)
    streams = torch.randn(1, seq_len, n, d, device=device, dtype=dtype, generator=gen).requires_grad_()
    block_out = torch.randn(1, seq_len, d, device=device, dtype=dtype, generator=gen).requires_grad_()
    with torch.no_grad():
        post, comb, _ = hc(streams)
    post, comb = post.requires_grad_(), comb.requires_grad_()
    dout = torch.randn(streams.shape, device=device, dtype=dtype, generator=gen)
    leaves = (streams, block_out, post, comb, *hc.parameters())

    def timed(call):
        return backward_step(call, dout, leaves)

    merge_now = torch.compile(hc.merge, backend=backend, fullgraph=True)
    merge_before = torch.compile(merge_bmm, backend=backend, fullgraph=True)

    def site(merge):
        def call():
            p, c, collapsed = hc(streams)
            return merge(streams, collapsed + block_out, p, c)  # the block's output stands in for f(collapsed)
        return torch.compile(call, backend=backend, fullgraph=True)

    return {"merge, mixing as bmm (before)": timed(lambda: merge_before(streams, block_out, post, comb)),
            "merge, mixing as an n-term sum (now)": timed(lambda: merge_now(streams, block_out, post, comb)),
            "site (maps + merge), bmm (before)": timed(site(merge_bmm)),
            "site (maps + merge), n-term sum (now)": timed(site(hc.merge))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int_list(), default=(4096,), help="comma-separated Ts")
    p.add_argument("--steps", type=at_least(1), default=20)
    p.add_argument("--warmup", type=at_least(0), default=5)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_mhc.py times CUDA kernels: needs CUDA", file=sys.stderr)
        return 2
    rows = []
    for seq_len in a.seq_len:
        for name, fn in variants(seq_len, "cuda", torch.bfloat16).items():
            row = dict(seq_len=seq_len, variant=name,
                       fwd_bwd_ms=round(median_ms(fn, steps=a.steps, warmup=a.warmup), 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, BF16\n")
    print("| T | variant | fwd+bwd ms |\n|---|---|---|")
    for r in rows:
        print(f"| {r['seq_len']} | {r['variant']} | {r['fwd_bwd_ms']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
