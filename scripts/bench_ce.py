"""Time of the fused LM-head cross-entropy (forward + backward) at the proxy's shape, and of its dW GEMM with
FP32 vs BF16 operands (the choice made in ops/linear_cross_entropy.py).

    python scripts/bench_ce.py --tokens 4096 --dim 4096 --vocab 154880
"""

from __future__ import annotations

import argparse
import json

import torch
from cuda_timing import at_least, median_ms

from torchtitan_glm.ops.linear_cross_entropy import linear_cross_entropy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=at_least(1), default=4096)
    p.add_argument("--dim", type=at_least(1), default=4096)
    p.add_argument("--vocab", type=at_least(1), default=154880)
    p.add_argument("--reps", type=at_least(1), default=10)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/bench_ce.py times CUDA kernels: no CUDA device is visible")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    h = torch.randn(a.tokens, a.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(a.vocab, a.dim, device=dev) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, a.vocab, (a.tokens,), device=dev)
    tw = torch.full((a.tokens,), 1.0 / a.tokens, device=dev)

    def ce_step() -> None:
        loss, _ = linear_cross_entropy(h, w, y, tw, chunk_size=4096)
        loss.backward()
        h.grad = w.grad = None

    g = torch.randn(a.tokens, a.vocab, device=dev).bfloat16()
    hd = h.detach()
    g32, h32 = g.float(), hd.float()
    gemm_flop = 2 * a.tokens * a.dim * a.vocab
    r = dict(tokens=a.tokens, dim=a.dim, vocab=a.vocab,
             fused_ce_fwd_bwd_ms=median_ms(ce_step, steps=a.reps, warmup=2),
             dw_gemm_fp32_ms=median_ms(lambda: g32.t() @ h32, steps=a.reps, warmup=2),
             dw_gemm_bf16_ms=median_ms(lambda: g.t() @ hd, steps=a.reps, warmup=2))
    r["dw_gemm_fp32_tflops"] = round(gemm_flop / r["dw_gemm_fp32_ms"] / 1e9, 1)
    r["dw_gemm_bf16_tflops"] = round(gemm_flop / r["dw_gemm_bf16_ms"] / 1e9, 1)
    r["device"] = torch.cuda.get_device_name(dev)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
