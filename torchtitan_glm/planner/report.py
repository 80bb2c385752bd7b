"""Text of a plan and of a layout search (scripts/plan.py prints these; --json prints Plan.to_json instead)."""

from __future__ import annotations

from .core import MEMORY_BUDGET, SEARCH_SCHEMA, Plan, assumptions
from .hardware import GIB

_LABELS = {"dense_gemm": "dense GEMMs", "dense_gemm_fp8": "dense GEMMs in FP8", "expert_gemm": "expert GEMMs",
           "expert_fp8_casts": "experts' FP8 casts",
           "lm_head_ce": "LM head + CE", "kda": "KDA",
           "dsa_attention": "DSA attention", "indexer_fp32": "indexer", "kl_target_fp32": "KL target",
           "elementwise": "elementwise", "optimizer": "optimizer + clip", "fsdp_copies": "FSDP2 copies",
           "recompute_modules_fp8": "recompute_modules in FP8"}


def _gib(x: float) -> str:
    """GiB to one decimal; below 1 GiB three significant digits, so a small model's figures do not print as 0.0."""
    g = x / GIB
    return f"{g:.1f}" if g >= 0.95 or g == 0 else f"{g:.3g}"


def _row(parts: dict[str, float], fmt, labels: dict[str, str] | None = None, *, skip_zero: bool = True) -> str:
    items = [(k, v) for k, v in parts.items() if v > 0 or not skip_zero]
    return " | ".join(f"{(labels or {}).get(k, k)} {fmt(v)}" for k, v in items)


def plan_text(p: Plan) -> str:
    r, m, t, cfg = p.request, p.memory, p.time, p.cfg
    argv = list(r.argv)
    config = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else next(
        (a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "(default config)")
    verdict = "accepts it" if p.verdict.accepted else f"REJECTS it today: {p.verdict.message}"
    budget = p.budget
    fit = "fits" if p.fits else "DOES NOT FIT"
    if not p.fits and m.peak <= budget < m.reserved:
        # the reserve is cached blocks (other streams' pools): the allocator releases them before it fails
        fit += (" by its reserve estimate (blocks cached in FSDP2's stream pools); the allocated peak is within "
                "the budget: it runs while the reserve stays under the card, past it the allocator releases cached "
                "blocks when an allocation would fail (a cost per step; training.device_memory_limit_gib holds a run "
                "to a limit). Where no parameter is split, parallelism.fsdp_reduce_in_compute_pool (unset: on "
                "there) keeps FSDP2's gradients in one pool")
    lines = [
        f"plan: {config} on {r.gpus} x {r.gpu.name} (scope {r.scope})",
        f"layout: {p.layout.describe()}; the trainer {verdict}; parallelisation: {p.design}",
        f"step: seq_len {cfg.training.seq_len} x local batch {cfg.training.local_batch_size} x dp {p.layout.dp}"
        + (f" x {t.micro} microbatches" if t.micro > 1 else "")
        + f" = {t.tokens_per_step:,} tokens (each row over cp={p.layout.cp} ranks); AC "
        f"{cfg.activation_checkpoint.mode} ({p.regime}"
        + (f", recompute_modules {','.join(cfg.activation_checkpoint.recompute_modules)}"
           if p.regime == "selective" and cfg.activation_checkpoint.recompute_modules else "")
        + f"); {p.float8_line}",
        f"memory per GPU: peak {_gib(m.peak)} GiB allocated ({m.peak_at}), reserve estimate {_gib(m.reserved)} GiB "
        f"({m.reserved_at}); budget {_gib(budget)} of {_gib(r.gpu.memory_bytes)} GiB -> {fit}",
        f"  at the peak (GiB): {_row(m.breakdown, _gib)}",
    ]
    if m.state is not None:
        s = m.state
        lines.append(f"  held (GiB): parameters {_gib(s.params)} | gradients {_gib(s.grads)} | optimizer "
                     f"{_gib(s.optimizer)}; of which FP32-kept, replicated: {_gib(s.replicated_params)} | "
                     f"{_gib(s.replicated_grads)} | {_gib(s.replicated_optimizer)}")
    if m.host_pinned:
        lines.append(f"  host memory per rank: {_gib(m.host_pinned)} GiB pinned (activation_checkpoint.offload_inputs: "
                     f"each checkpointed block's inputs, held from its forward to its backward)")
    lines.append(f"  activations kept, by layer type (GiB): {_row(m.activations_by_type, _gib)}; the fused CE's "
                 f"chunk works in {_gib(m.ce_chunk_working)} more")
    top = dict(sorted(m.activation_terms.items(), key=lambda kv: -kv[1])[:8])
    lines.append(f"  largest activation terms (GiB): {_row(top, _gib)}")
    exposed = sum(t.exposed_comm_s.values())
    lines += [
        f"time per step: {t.step_s:.3f} s = compute {sum(t.compute_s.values()):.3f} s + exposed communication "
        f"{exposed:.3f} s",
        f"  compute (s): {_row(t.compute_s, lambda v: f'{v:.3f}', _LABELS)}",
        f"  exposed communication (s): {_row(t.exposed_comm_s, lambda v: f'{v:.3f}') or 'none'}",
    ]
    if t.fp8:
        f = t.fp8
        lines.append(f"  FP8: the converted GEMMs take {f['converted_s']:.3f} s ({f['converted_bf16_s']:.3f} s in "
                     f"BF16, {f['share_of_bf16_step']:.0%} of the BF16 step): {f['speedup']:.3f}x over BF16 as "
                     f"planned, at most {f['speedup_at_2x']:.3f}x at twice the BF16 rate, {f['speedup_if_free']:.3f}x "
                     "were they free")
        if f.get("experts_net_s", 0.0) > 0:
            lines.append(f"  FP8 routed experts take {f['experts_net_s']:.3f} s more than in BF16 (torchao's casts of "
                         "their operands and weights): float8.moe_experts = false plans faster")
    if t.collectives:
        per = "per microbatch" if t.micro > 1 else "per step"
        lines.append(f"  collectives {per}, per rank (all units): name | group | calls | GB sent | link | seconds "
                     "| hidden behind compute")
        merged: dict[tuple, list[float]] = {}
        for c in t.collectives:
            key = (c.name, c.group, c.link, c.overlapped)
            acc = merged.setdefault(key, [0, 0.0, 0.0])
            acc[0] += c.calls
            acc[1] += c.bytes_per_rank
            acc[2] += c.seconds
        for (name, group, link, hidden), (calls, nbytes, secs) in merged.items():
            lines.append(f"    {name} | {group} | {calls} | {nbytes / 1e9:.2f} | {link} | {secs:.3f} | "
                         f"{'yes' if hidden else 'no'}")
    mfu = f"{100 * t.mfu:.1f}%" if t.mfu is not None else "-"
    lines.append(f"throughput: {t.tokens_per_s:,.0f} tokens/s ({t.tokens_per_s_per_gpu:,.0f} per GPU); "
                 f"{t.flops_per_token / 1e9:.1f} GFLOP/token (metrics.flops_per_token); MFU {mfu} of "
                 f"{r.gpu.peak_bf16 / 1e12:.0f} TFLOP/s")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in assumptions(r.gpu)]
    return "\n".join(lines)


def search_rows(plans: list[Plan]) -> list[str]:
    out = ["rank | layout | AC | local batch | peak / reserve GiB | tokens/s | per GPU | MFU | trainer today"]  # noqa
    for i, p in enumerate(plans, 1):
        t, m = p.time, p.memory
        mfu = f"{100 * t.mfu:.1f}%" if t.mfu is not None else "-"
        out.append(f"{i} | {p.layout.describe()} | {p.cfg.activation_checkpoint.mode} | "
                   f"{p.cfg.training.local_batch_size} | {_gib(m.peak)} / {_gib(m.reserved)} | {t.tokens_per_s:,.0f} | "
                   f"{t.tokens_per_s_per_gpu:,.0f} | {mfu} | {'accepts' if p.verdict.accepted else 'rejects'}")
    return out


def search_text(result: dict, *, gpus: int, gpu_name: str) -> str:
    plans, fitting = result["plans"], result["fitting"]
    lines = [f"search: {result['candidates']} layouts of {gpus} x {gpu_name} the cost model describes, "
             f"{len(result['rejected'])} rejected by the trainer today; {len(plans)} plans, {len(fitting)} fit "
             f"within {MEMORY_BUDGET:.0%} of the card"
             + (f" and {result['memory_limit_gib']:g} GiB (training.device_memory_limit_gib)"
                if result.get("memory_limit_gib") else "")]
    if not fitting:
        closest = sorted(plans, key=lambda p: max(p.memory.peak, p.memory.reserved))[:3]
        lines.append("nothing fits; the closest:" if closest else "nothing to plan (every layout was rejected; "
                     "--what-if plans them anyway)")
        lines += search_rows(closest)
        if result["rejected"] and not plans:
            first = next(iter(result["rejected"].items()))
            lines.append(f"e.g. {first[0]}: {first[1]}")
        return "\n".join(lines)
    lines += search_rows(result["top"])
    lines += ["", "best:", plan_text(result["top"][0])]
    return "\n".join(lines)


def search_json(result: dict, *, gpus: int, gpu_name: str) -> dict:
    return {"schema": SEARCH_SCHEMA, "gpus": gpus, "gpu": gpu_name, "candidates": result["candidates"],
            "rejected_by_trainer": len(result["rejected"]), "planned": len(result["plans"]),
            "fitting": len(result["fitting"]), "top": [p.to_json() for p in result["top"]]}
