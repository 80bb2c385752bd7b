"""One KDA block, forward + backward, on one GPU: ours (models/glm5/kda.py: projections, short convs, decay gate, the
FLA chunk kernel behind our custom op, gated norm, output projection), eager and compiled with inductor, against
FLA's stock `fla.layers.KimiDeltaAttention` built with the same shapes (issue 12's target: ours compiled >= 1.2x).

    python scripts/bench_kda.py                                   # T = 8192, the flavor's KDA shapes, BF16
    python scripts/bench_kda.py --seq-len 4096,8192 --flavor glm5_3_flash_proxy --json kda.json [--profile]

Both layers take BF16 parameters and a [1, T, hidden] BF16 input (one document), safe gate with the flavor's lower
bound, and are timed with CUDA events (median of --steps after --warmup; the first calls autotune FLA's kernels and
compile ours). Prints one JSON line per variant and a markdown table with the ratio to FLA's layer.

The parts each layer is made of are timed too, so the table shows what the blocks cost beyond them:
- "parts: the block's GEMMs": the nine projections of the block, forward + backward, and nothing else;
- "parts: FLA chunk_kda, as the stock layer calls it": the kernel with q/k L2 norm, gate and beta sigmoid inside it
  and the V-first state layout (fla/layers/kda.py);
- "parts: FLA chunk_kda, gate computed outside": the same kernel given the FP32 log decay and beta, as our op is;
- "parts: our KDA op": ops/kda.py's custom op (FLA's forward and backward pieces, with the L2 norms and the gate's
  cumsum recomputed in backward), given the same FP32 log decay and beta; "save_states": the same op keeping FLA's
  forward intermediates for its backward (activation_checkpoint.kda_disable_recompute; FLA's disable_recompute).
"ours, compiled, kda_disable_recompute" is the compiled block with that setting (its peak shows what it keeps).
The "floor" line adds the GEMMs and the stock kernel: a block built of these parts costs at least that much.
--profile prints the CUDA kernels of one fwd + bwd of each block (torch.profiler), to say where the rest goes.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from cuda_timing import at_least, backward_step, int_list, median_ms


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


def gemm_part(block: torch.nn.Module, x: torch.Tensor, gen: torch.Generator):
    """The block's nine projections, forward + backward, on x [1, T, hidden] (o_proj on a random [1, T, H*V]
    input): what the GEMMs alone cost."""
    inner = block.o_proj.in_features
    o_in = torch.randn(*x.shape[:-1], inner, device=x.device, dtype=x.dtype, generator=gen).requires_grad_()
    params = list(block.parameters())

    def outputs():
        return [block.q_proj(x), block.k_proj(x), block.v_proj(x), block.f_b_proj(block.f_a_proj(x)),
                block.g_b_proj(block.g_a_proj(x)), block.b_proj(x), block.o_proj(o_in)]

    grads = [torch.randn(o.shape, device=x.device, dtype=x.dtype, generator=gen) for o in outputs()]

    def run():
        torch.autograd.backward(outputs(), grads)
        x.grad = o_in.grad = None
        for p in params:
            p.grad = None
    return run


def kernel_parts(args, seq_len: int, device: str, dtype: torch.dtype, gen: torch.Generator, *,
                 with_fla: bool) -> dict:
    """The KDA core alone, forward + backward, at the block's shapes: our op, and (with_fla) FLA's chunk_kda called
    as its stock layer calls it and with the gate computed outside."""
    from torchtitan_glm.models.glm5.kda_gate import kda_log_decay
    from torchtitan_glm.ops.kda import kda as kda_op

    h, k, lb = args.linear_num_heads, args.linear_head_dim, args.linear_lower_bound
    safe = lb is not None and -5.0 <= lb < 0

    def rand(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, device=device, dtype=torch.float32, generator=gen) * scale).to(dt)

    q, kk, v, f = (rand(1, seq_len, h, k).requires_grad_() for _ in range(4))
    b_raw = rand(1, seq_len, h).requires_grad_()
    a_log = torch.zeros(h, device=device, dtype=torch.float32, requires_grad=True)
    dt_bias = rand(h * k, dt=torch.float32, scale=0.1).requires_grad_()
    with torch.no_grad():  # the decay and beta our op (and the outside-gate call) take, made once, not timed
        g = kda_log_decay(f.flatten(-2), a_log, dt_bias, head_dim=k, lower_bound=lb).requires_grad_()
        beta = torch.sigmoid(b_raw).requires_grad_()
    do = rand(1, seq_len, h, k)
    leaves = (q, kk, v, f, b_raw, a_log, dt_bias, g, beta)

    def timed(call):
        return backward_step(call, do, leaves)

    parts = {"parts: our KDA op (gate computed outside)": timed(
        lambda: kda_op(q, kk, v, g, beta, None, safe_gate=safe)),
        "parts: our KDA op, save_states (gate computed outside)": timed(
        lambda: kda_op(q, kk, v, g, beta, None, safe_gate=safe, save_states=True))}
    if with_fla:
        from fla.ops.kda import chunk_kda

        parts["parts: FLA chunk_kda, as the stock layer calls it"] = timed(lambda: chunk_kda(
            q=q, k=kk, v=v, g=f, beta=b_raw, A_log=a_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=safe, lower_bound=lb,
            state_v_first=True)[0])
        parts["parts: FLA chunk_kda, gate computed outside"] = timed(lambda: chunk_kda(
            q=q, k=kk, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, safe_gate=safe)[0])
    return parts


def variants(flavor: str, seq_len: int, device: str, dtype: torch.dtype, *, with_fla: bool,
             compile_ours: bool = True) -> tuple[dict, object]:
    """{name: fwd+bwd closure} at one T: the blocks, then their parts (see the module docstring)."""
    from torchtitan_glm.models.glm5.batch import batch_layout

    ours, args = our_block(flavor, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, seq_len, args.hidden_size, device=device, dtype=dtype, generator=gen).requires_grad_()
    dout = torch.randn(1, seq_len, args.hidden_size, device=device, dtype=dtype, generator=gen)
    layout = batch_layout(None, (1, seq_len), torch.device(device))
    out = {}
    if with_fla:
        stock = fla_block(args, device, dtype)
        out["FLA KimiDeltaAttention (stock layer)"] = fwd_bwd(lambda t: stock(t)[0], list(stock.parameters()), x,
                                                              dout)
    out["ours, eager"] = fwd_bwd(lambda t: ours(t, layout), list(ours.parameters()), x, dout)
    if compile_ours:
        compiled = torch.compile(ours, fullgraph=True, backend="inductor")
        out["ours, compiled (inductor)"] = fwd_bwd(lambda t: compiled(t, layout), list(ours.parameters()), x, dout)
        saving, _ = our_block(flavor, device, dtype)
        saving.load_state_dict(ours.state_dict())
        saving.save_states = True  # what activation_checkpoint.kda_disable_recompute sets
        compiled_saving = torch.compile(saving, fullgraph=True, backend="inductor")
        out["ours, compiled, kda_disable_recompute"] = fwd_bwd(lambda t: compiled_saving(t, layout),
                                                               list(saving.parameters()), x, dout)
    out["parts: the block's GEMMs"] = gemm_part(ours, x, gen)
    out.update(kernel_parts(args, seq_len, device, dtype, gen, with_fla=with_fla))
    return out, args


def profile(name: str, fn, *, rows: int = 20) -> None:
    """The CUDA kernels of one call of fn (after the timed runs: compiled and autotuned), by total CUDA time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"\n### profile: {name}\n")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="glm5_3_flash_proxy")
    p.add_argument("--seq-len", type=int_list(), default=(8192,), help="comma-separated Ts")
    p.add_argument("--steps", type=at_least(1), default=10)
    p.add_argument("--warmup", type=at_least(0), default=3)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--profile", action="store_true", help="print the CUDA kernels of each block's fwd + bwd")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_kda.py times CUDA kernels (FLA's layer needs CUDA)", file=sys.stderr)
        return 2
    dtype, device = torch.bfloat16, "cuda"
    rows = []
    for seq_len in a.seq_len:
        fns, args = variants(a.flavor, seq_len, device, dtype, with_fla=True)
        base = None
        for name, fn in fns.items():
            torch.cuda.reset_peak_memory_stats()
            ms = median_ms(fn, steps=a.steps, warmup=a.warmup)
            base = base or ms
            row = dict(seq_len=seq_len, variant=name, fwd_bwd_ms=round(ms, 3), speedup_vs_fla=round(base / ms, 3),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.profile and not name.startswith("parts"):
                profile(f"T = {seq_len}, {name}", fn)
        at_t = {r["variant"]: r["fwd_bwd_ms"] for r in rows if r["seq_len"] == seq_len}
        floor = at_t["parts: the block's GEMMs"] + at_t["parts: FLA chunk_kda, as the stock layer calls it"]
        row = dict(seq_len=seq_len, variant="floor: the GEMMs + the stock kernel (a sum, not timed)",
                   fwd_bwd_ms=round(floor, 3), speedup_vs_fla=round(base / floor, 3), peak_gib=None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del fns
        torch.cuda.empty_cache()
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
