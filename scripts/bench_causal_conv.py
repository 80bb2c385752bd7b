"""The KDA short conv alone on CUDA: forward and backward of the Triton kernels (ops/causal_conv_triton.py) against
FLA's `causal_conv1d` (the stock KimiDeltaAttention layer's conv, SiLU fused) at one conv's shape, BF16.

    python scripts/bench_causal_conv.py [--seq-len 8192] [--channels 8192] [--docs 0|N] [--variant FILE ...]

Each row: median CUDA-event milliseconds of the forward, and of forward + backward (dx and dw); the backward's
effective HBM rate counts the bytes it must move (x and dy read, dx written). `--docs N` packs N documents per row
(positions on the device; FLA gets the same documents as cu_seqlens). `--variant FILE` times another copy of the
kernels module (e.g. `git show REV:torchtitan_glm/ops/causal_conv_triton.py > /tmp/old.py`) on the same inputs,
after checking it against the reference.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cuda_timing import at_least, median_ms, print_table  # noqa: E402

from torchtitan_glm.ops.causal_conv import causal_conv_silu_reference_bwd  # noqa: E402


def _load(path: str):
    spec = importlib.util.spec_from_file_location(f"conv_variant_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(seqlen: int, ch: int, docs: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, seqlen, ch, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(ch, 4, device="cuda", generator=gen) * 0.5).bfloat16()
    dy = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()
    pos = cu = None
    if docs > 1:  # equal documents; the last takes the remainder
        length = seqlen // docs
        starts = torch.arange(docs, device="cuda") * length
        cu = torch.cat([starts, torch.tensor([seqlen], device="cuda")]).to(torch.int32)
        idx = torch.arange(seqlen, device="cuda")
        pos = (idx - starts[(idx // length).clamp(max=docs - 1)]).unsqueeze(0)
    return x, w, dy, pos, cu


def _kernel_rows(name: str, mod, x, w, dy, pos, steps: int, warmup: int, moved: int) -> dict:
    dx, dw = mod.causal_conv_silu_bwd_triton(dy, x, w, pos)
    dx_ref, dw_ref, _ = causal_conv_silu_reference_bwd(dy, x, w, pos, None)
    torch.testing.assert_close(dx, dx_ref, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(dw.to(dw_ref.dtype), dw_ref, rtol=2e-2, atol=1e-2 * float(dw_ref.abs().max()))
    fwd = median_ms(lambda: mod.causal_conv_silu_fwd_triton(x, w, pos), steps=steps, warmup=warmup)
    bwd = median_ms(lambda: mod.causal_conv_silu_bwd_triton(dy, x, w, pos), steps=steps, warmup=warmup)
    return {"variant": name, "fwd_ms": round(fwd, 4), "bwd_ms": round(bwd, 4),
            "bwd_tbps": round(moved / bwd / 1e9, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=at_least(1), default=8192)
    p.add_argument("--channels", type=at_least(1), default=8192, help="one conv's channels (the proxy: 64 heads x 128)")
    p.add_argument("--docs", type=int, default=0, help="documents per row (0: one, no positions)")
    p.add_argument("--variant", action="append", default=[], help="another kernels module file to time")
    p.add_argument("--steps", type=at_least(1), default=50)
    p.add_argument("--warmup", type=at_least(0), default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not 0 <= a.docs <= a.seq_len:
        p.error(f"--docs {a.docs}: documents per row must be between 0 and --seq-len ({a.seq_len})")
    if not torch.cuda.is_available():
        p.error("this benchmark times CUDA kernels and no CUDA device is visible")
    from torchtitan_glm.ops import causal_conv_triton

    x, w, dy, pos, cu = _inputs(a.seq_len, a.channels, a.docs)
    moved = 3 * x.numel() * x.element_size()  # x, dy read; dx written (the floor of any backward)
    rows = [_kernel_rows("ours (ops/causal_conv_triton.py)", causal_conv_triton, x, w, dy, pos, a.steps, a.warmup,
                         moved)]
    for path in a.variant:
        rows.append(_kernel_rows(f"variant {path}", _load(path), x, w, dy, pos, a.steps, a.warmup, moved))
    try:
        from fla.modules.convolution import causal_conv1d
    except ImportError:
        causal_conv1d = None
    if causal_conv1d is not None:
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)

        def fla_fwd():
            return causal_conv1d(xl, weight=wl, activation="silu", cu_seqlens=cu)[0]

        fwd = median_ms(lambda: fla_fwd(), steps=a.steps, warmup=a.warmup)
        both = median_ms(lambda: torch.autograd.grad(fla_fwd(), (xl, wl), dy), steps=a.steps, warmup=a.warmup)
        rows.append({"variant": "FLA causal_conv1d (silu)", "fwd_ms": round(fwd, 4), "bwd_ms": round(both - fwd, 4),
                     "bwd_tbps": round(moved / (both - fwd) / 1e9, 2)})
    title = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}: one short conv, T = {a.seq_len}, "
             f"C = {a.channels}, 4 taps, BF16, {max(1, a.docs)} document(s); FLA's backward = fwd+bwd - fwd")
    print_table(title, {"variant": "variant", "fwd ms": "fwd_ms", "bwd ms": "bwd_ms",
                        "bwd TB/s (x, dy, dx)": "bwd_tbps"}, rows, a.json)


if __name__ == "__main__":
    main()
