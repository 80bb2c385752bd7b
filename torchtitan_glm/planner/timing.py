"""Step time of one rank: compute from measured kernel rates, plus the communication that compute does not hide.

Compute terms (FLOPs from the trainer's own counts, times from measured rates, hardware.py):
- GEMMs: dense projections at the BF16 GEMM rate, those Float8Linear converts as their own term at the measured
  FP8 speed-up (`dense_gemm_fp8`), routed experts at the measured grouped-GEMM rate (x the FP8 grouped kernels'
  speed-up when FP8, plus torchao's casts of their operands, `expert_fp8_casts`: bytes at a measured fraction of HBM
  speed, a cost per expert weight that does not shrink with the tokens), the fused LM-head CE at its measured time
  per row; full AC recomputes every forward GEMM, selective AC the grouped expert GEMMs (a custom op its policy
  does not save), and under EP the experts' op runs their forward again in its backward. With FP8, `fp8_bound`
  says what it gives the step and could give at most.
- KDA at FLA's measured time per token and head; DSA attention as the absorbed sparse MLA over the K selected
  tokens (measured rate), or (the dense warm-up, and rows of at most dsa_dense_max_len) masked SDPA over every key
  up to each query chunk's last (measured cuDNN rate), a one-document row's leading causal rows at the measured
  causal SDPA rate; the indexer's tiled top-k and KL (scores, their gradients and the KL target's logits) run in
  FP32 at the measured FP32 rate.
- activation_checkpoint.recompute_modules (selective): the listed parts' forward once more in the backward, at
  the same rates (`recompute_modules`; the converted projections' share `recompute_modules_fp8`).
- Memory-bound work (mHC, norms, gates, convs, routing) that no FLOP count sees: a time per token and block, the
  residual of the measured proxy benchmark after the terms above (hardware.GpuSpec.elementwise_s_per_token_block).
- train.py's own work (scope "train"): the optimizer step at its measured time per trainable element (AdamW8bit;
  AdamW and AdamWFp8 by the bytes they stream at HBM speed), the gradient clip's 12 bytes per element, and FSDP2's
  copies and casts around its collectives at their measured time per gathered and per reduced element.
Communication: FSDP all-gathers and reduce-scatters run on side streams and hide behind the neighbouring unit's
compute (a unit exposes what its collectives take beyond that compute); expert all-to-all, tensor- and context-
parallel collectives and the replicated-gradient all-reduce are on the critical path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan_glm.components.metrics import flops_breakdown, flops_per_token
from torchtitan_glm.ops.masked_attention import masked_keys_per_query

from .activations import ActContext, offloaded_inputs, selected_tokens
from .comms import Collective, fsdp_collectives, other_collectives
from .hardware import GpuSpec
from .layout import Layout
from .model import ModelInventory
from .params import local_trainable_elements, trainable_unit_bytes, unit_bytes

# Bytes per trainable element where no time is measured. AdamW: read p, g, m, v and write p, m, v (FP32: 28 B);
# AdamWFp8 / AdamW8bit: the moments 1 B each (16 B: the fused step's one pass; torchao's compiled step is not one
# pass, and without its own measured rate takes AdamW8bit's). The clip: the norm reads g, the scale reads and
# writes it (12 B).
OPTIMIZER_BYTES_PER_PARAM = {"AdamW": 28, "AdamWFp8": 16, "AdamW8bit": 16}
CLIP_BYTES_PER_PARAM = 12


def optimizer_seconds(name: str, elements: int, gpu: GpuSpec, implementation: str) -> float:
    """The optimizer step plus the gradient clip over `elements` trainable elements of one rank; `implementation`
    resolved (components/optimizer.py::resolved_implementation). Measured rates are keyed by name for AdamW and
    "<name> <implementation>" for the low-bit AdamWs."""
    key = name if name == "AdamW" else f"{name} {implementation}"
    rate = gpu.optimizer_s_per_param.get(key)
    if rate is None and implementation == "compiled":
        rate = gpu.optimizer_s_per_param.get("AdamW8bit compiled")
    step = elements * rate if rate is not None else elements * OPTIMIZER_BYTES_PER_PARAM[name] / gpu.hbm_bandwidth
    return step + elements * CLIP_BYTES_PER_PARAM / gpu.hbm_bandwidth


def fsdp_copy_seconds(inv: ModelInventory, layout: Layout, gpu: GpuSpec, *, with_mtp: bool, micro: int = 1) -> float:
    """FSDP2's copies and casts on one rank per optimizer step of `micro` microbatches: each unit's unsharded
    parameters once per all-gather (forward, and again for backward when the unit reshards; under "never" once per
    step: distributed/grad_accumulation.py holds them between microbatches), its unsharded trainable gradients once
    per reduce (per microbatch, or once where no parameter is split over ranks and the reduce is deferred)."""
    units = [u for u in inv.units if with_mtp or u.kind != "mtp"]
    hold = micro > 1 and not any(u.reshard_after_forward for u in inv.units)
    gathers = 1 if hold else micro
    reduces = 1 if layout.reduce_deferred else micro
    gathered = sum(unit_bytes(u, layout, dtype_bytes=1, sharded=False) * (1 + int(u.reshard_after_forward))
                   for u in units)
    reduced = sum(trainable_unit_bytes(u, layout, dtype_bytes=1) for u in units)
    return gathers * gathered * gpu.fsdp_gather_copy_s_per_elem + reduces * reduced * gpu.fsdp_reduce_copy_s_per_elem


@dataclass
class TimePlan:
    step_s: float
    compute_s: dict[str, float]
    exposed_comm_s: dict[str, float]
    collectives: list[Collective]
    tokens_per_step: int  # global
    tokens_per_s: float  # global
    tokens_per_s_per_gpu: float
    flops_per_token: float
    mfu: float | None
    micro: int = 1  # microbatches per step (training.global_batch_size); `collectives` are one microbatch's
    fp8: dict[str, float] | None = None  # fp8_bound: what FP8 gives this step and can give at most


def _layers(inv: ModelInventory, with_mtp: bool) -> list:
    return [u for u in inv.units if u.kind not in ("embed", "head") and (with_mtp or u.kind != "mtp")]


def compute_terms(inv: ModelInventory, gpu: GpuSpec, ctx: ActContext, *, regime: str, with_mtp: bool,
                  layout: Layout, train: bool = True, micro: int = 1) -> dict[str, float]:
    """Seconds of compute per optimizer step of `micro` microbatches (training.global_batch_size) on one rank, by
    term. Tensor parallelism divides the heads' and MLP columns' work; what its plan keeps whole (mHC, norms, router,
    routed experts, LM head, MLA latents, indexer) every tp rank computes."""
    args = inv.args
    tokens = ctx.tokens
    tp = ctx.tp
    seq = ctx.keys
    layers = _layers(inv, with_mtp)
    n_moe = sum(1 for u in layers if u.kind.endswith("moe") or u.kind == "mtp")
    n_kda = sum(1 for u in layers if u.kind.startswith("kda"))
    dsa = [u for u in layers if "dsa" in u.kind or u.kind == "mtp"]
    n_idx = sum(1 for u in dsa if not u.shared_indexer)
    d, vocab = args.hidden_size, args.vocab_size
    fb = flops_breakdown(args if with_mtp else args.replace(num_nextn_predict_layers=0), seq)
    expert = 6.0 * args.num_experts_per_tok * 3 * d * args.moe_intermediate_size * n_moe
    heads = 1 + int(with_mtp)
    dense = fb.params - expert - 6.0 * vocab * d * heads
    dense *= inv.dense_tp_fraction / tp + (1 - inv.dense_tp_fraction)
    recompute_fwd = {"full": 1.0, "selective": 0.0}.get(regime, 0.0)
    fp8, converted = dense_fp8(inv, gpu)
    dense_s = dense * tokens * (1 + recompute_fwd / 3) / gpu.gemm_bf16  # all of it at the BF16 rate
    expert_rate = gpu.gemm_grouped_bf16 * (gpu.fp8_speedup_grouped if inv.expert_fp8 else 1.0)
    # forwards of the routed experts run again in the backward: AC's recompute, one per moe_chunk_tokens chunk's
    # checkpoint, and under EP the experts' op itself (ops/expert_parallel.py: ep_swiglu_bwd re-runs the local
    # experts to differentiate them)
    expert_forwards = (regime in ("full", "selective")) + (ctx.expert_share < 1) + (layout.ep > 1)
    out = {
        "dense_gemm": dense_s * (1 - converted),
        "dense_gemm_fp8": dense_s * converted / fp8,  # what Float8Linear converts (0 without FP8)
        # forward + backward (3 forwards' worth), and each forward run again (above)
        "expert_gemm": expert * tokens * (1 + expert_forwards / 3) / expert_rate,
        "lm_head_ce": gpu.fused_ce_s_per_token * tokens * heads * (vocab / 154880) * (d / 4096),
        "kda": n_kda * tokens * args.linear_num_heads / tp * (gpu.kda_fwd_bwd_s_per_token_head
                                                               + recompute_fwd * gpu.kda_fwd_s_per_token_head),
    }
    if inv.expert_fp8:
        cast = expert_fp8_cast_bytes(args, tokens=tokens, ep=layout.ep, calls=_expert_calls(ctx),
                                     forwards=1 + expert_forwards)
        out["expert_fp8_casts"] = n_moe * cast / (gpu.hbm_bandwidth * gpu.fp8_cast_efficiency)
    h, dqk, dv, kvl = args.num_attention_heads, args.qk_head_dim, args.v_head_dim, args.kv_lora_rank
    ih, idim, kp = args.index_n_heads, args.index_head_dim, args.index_kpool
    big_k = selected_tokens(args, seq)
    k_pools = min(args.index_topk // kp, seq // kp)
    pools = seq // kp
    if not args.dense_dsa_kernel(seq):  # absorbed MLA over K gathered latents: QK and PV both kv_lora_rank wide
        attn_fwd_s = len(dsa) * 2.0 * tokens * big_k * h / tp * 2 * kvl / gpu.attention_sparse
    else:  # masked SDPA (dense warm-up, or rows <= dsa_dense_max_len): every key up to each query chunk's last;
        # one-document rows (data.document_masking false) run their leading causal rows with no mask
        keys, causal = masked_keys_per_query(seq, args.dsa_mask_query_chunk if ctx.cp == 1 else 0,
                                             ctx.causal_dsa_rows)
        attn_fwd_s = len(dsa) * 2.0 * tokens * h / tp * (dqk + dv) * (keys / gpu.attention_masked
                                                                        + causal / gpu.attention_causal)
    out["dsa_attention"] = attn_fwd_s * (3.5 + recompute_fwd)  # forward + backward (2.5x the forward)
    # the indexer's tiled FP32 ops (causal: on average half the pools / keys of the row), recomputed under full AC
    topk = 2.0 * tokens * ih * (idim + 1) * pools / 2 if args.dsa_attention == "sparse" else 0.0
    kl = 0.0
    if ctx.collect_stats:
        if ctx.sparse_kl:
            kl = 6.0 * tokens * ih * idim * k_pools + 2.0 * tokens * big_k * h * kvl
        else:
            kl = 6.0 * tokens * ih * idim * pools / 2 + 2.0 * tokens * seq / 2 * h * kvl
    out["indexer_fp32"] = n_idx * (topk + kl) * (1 + recompute_fwd) / gpu.gemm_fp32
    if regime == "selective" and ctx.recompute:
        out["recompute_modules"], out["recompute_modules_fp8"] = _recompute_seconds(
            args, ctx, gpu, layers=layers, fp8_roles=inv.fp8_roles, fp8=fp8, attn=attn_fwd_s,
            indexer=(topk + kl) * n_idx / gpu.gemm_fp32)
    # an eager run under AC (ctx.compiled false) pays eager's elementwise launches, in the forward and the recompute
    rate = regime if ctx.compiled or regime in ("compiled", "eager") else f"eager_{regime}"
    out["elementwise"] = gpu.elementwise_s_per_token_block[rate] * tokens * len(layers)
    out = {k: v * micro for k, v in out.items()}
    if train:
        out["optimizer"] = optimizer_seconds(inv.optimizer, local_trainable_elements(inv, layout), gpu,
                                             inv.optimizer_implementation)
        out["fsdp_copies"] = fsdp_copy_seconds(inv, layout, gpu, with_mtp=with_mtp, micro=micro)
    return out


def _recompute_seconds(args, ctx: ActContext, gpu: GpuSpec, *, layers: list, fp8_roles: frozenset[str], fp8: float,
                       attn: float, indexer: float) -> tuple[float, float]:
    """Seconds the forward of the recompute_modules parts takes again in the backward (one microbatch), as (the
    rest, the GEMMs of roles Float8Linear converts at the FP8 speed-up `fp8`): the other GEMMs at the BF16 rate, the
    KDA kernel's forward, the attention's forward (`attn`) and the indexer's tiled ops (`indexer`, the whole op: its
    KL forms its gradients in the forward)."""
    tokens, tp = ctx.tokens, ctx.tp
    d, n = args.hidden_size, args.hc_mult
    kinds = [u.kind for u in layers]
    n_kda = sum(k.startswith("kda") for k in kinds)
    n_dsa = sum("dsa" in k or k == "mtp" for k in kinds)
    n_moe = sum(k.endswith("moe") or k == "mtp" for k in kinds)
    n_dense = sum(k.endswith("dense") for k in kinds)
    gemm: dict[str, float] = {}  # forward FLOPs of the recomputed projections, by Linear role
    seconds = 0.0

    def add(role: str, flops: float) -> None:
        gemm[role] = gemm.get(role, 0.0) + flops
    if ctx.recomputes("kda"):
        h, k = args.linear_num_heads, args.linear_head_dim
        hk = h * k
        add("kda", n_kda * 2 * (4 * d * hk / tp + 2 * k * hk / tp + 2 * d * k + d * h / tp))
        seconds += n_kda * tokens * h / tp * gpu.kda_fwd_s_per_token_head
    if ctx.recomputes("mla_up_proj"):
        h = args.num_attention_heads
        up = args.q_lora_rank * h * args.qk_head_dim
        if args.dense_dsa_kernel(ctx.keys):
            up += args.kv_lora_rank * h * (args.qk_head_dim + args.v_head_dim)
        add("mla", n_dsa * 2 * up / tp)
    if ctx.recomputes("sparse_attn"):
        seconds += attn
    if ctx.recomputes("indexer"):
        ih, idim = args.index_n_heads, args.index_head_dim
        add("indexer", n_dsa * 2 * (args.q_lora_rank * ih * idim + d * idim + d * ih))
        seconds += indexer
    if ctx.recomputes("moe"):
        add("shared_expert", n_moe * 2 * 3 * d * args.moe_intermediate_size * args.n_shared_experts / tp)
        add("router", n_moe * 2 * d * args.n_routed_experts)  # never converted
    if ctx.recomputes("mlp"):
        add("mlp", n_dense * 2 * 3 * d * args.intermediate_size / tp)
    if ctx.recomputes("mhc"):  # the maps' FP32 projection, two sites per layer
        seconds += len(kinds) * 2 * 2 * n * d * (2 + n) * n * tokens / gpu.gemm_fp32
    kept = sum(f for role, f in gemm.items() if role not in fp8_roles)
    converted = sum(f for role, f in gemm.items() if role in fp8_roles)
    return seconds + kept * tokens / gpu.gemm_bf16, converted * tokens / (gpu.gemm_bf16 * fp8)


def _expert_calls(ctx: ActContext) -> int:
    """Grouped-GEMM calls per routed-expert weight and forward: one per moe_chunk_tokens chunk."""
    return -(-ctx.tokens // ctx.moe_chunk) if 0 < ctx.moe_chunk < ctx.tokens else 1


def expert_fp8_cast_bytes(args, *, tokens: int, ep: int, calls: int, forwards: int) -> float:
    """Bytes torchao's FP8 rowwise grouped GEMM (prototype.moe_training) casts per MoE layer and step: each cast
    reads BF16 and writes E4M3, 3 bytes per element. With N = tokens x top-k routed rows, hidden d, expert width F:
    - each forward: the gate's and the up projection's input [N, d] rowwise (each its own call), the down
      projection's [N, F], and every weight [E, d, F] per output column, once per call;
    - the backward: the output gradients rowwise ([N, F] twice, [N, d]); the wgrad operands per (group, column),
      every gradient and input once more (9 N (d + F)); every weight again per input row, once per call."""
    d, f = args.hidden_size, args.moe_intermediate_size
    rows = tokens * args.num_experts_per_tok
    weights = 3 * (args.n_routed_experts // ep) * d * f
    forward = 3 * (rows * (2 * d + f) + weights * calls)
    # the backward's weight cast is two kernels (scales, then cast: triton_fp8_rowwise_3d_transpose_rhs), so the
    # weights are read twice there: 5 bytes per element
    backward = 3 * (rows * (2 * f + d) + 3 * rows * (d + f)) + 5 * weights * calls
    return float(forward * forwards + backward)


def dense_fp8(inv: ModelInventory, gpu: GpuSpec) -> tuple[float, float]:
    """(speed-up, share): the measured FP8 speed-up of the dense projections Float8Linear converts, and their share
    of the dense projections' FLOPs (0 without FP8). Times add: the converted share is timed as its own term."""
    if not inv.fp8_recipe:
        return 1.0, 0.0
    speedup = gpu.fp8_speedup_tensorwise if inv.fp8_recipe == "tensorwise" else gpu.fp8_speedup_rowwise
    return speedup, inv.dense_fp8_fraction


def fp8_bound(compute: dict[str, float], inv: ModelInventory, gpu: GpuSpec,
              step_of: Callable[[float], float]) -> dict[str, float] | None:
    """What FP8 can give this step (None without FP8): the converted GEMMs' seconds (`compute`'s FP8 terms, the
    routed experts' casts included) and their seconds in BF16, and the step's speed-up over BF16 as planned, were
    those GEMMs at twice the BF16 rate (FP8's peak over BF16's on Hopper), and were they free. `step_of(total
    compute)` is the step with the communication that compute leaves exposed; the rest of the compute stays as
    planned (an Amdahl bound). With FP8 routed experts, `experts_net_s`: their seconds with the casts less their
    seconds in BF16 (positive: float8.moe_experts = false plans faster)."""
    if not inv.fp8_recipe:  # model.inventory: None when nothing is converted
        return None
    fp8, _ = dense_fp8(inv, gpu)
    dense = compute["dense_gemm_fp8"] + compute.get("recompute_modules_fp8", 0.0)
    experts = compute["expert_gemm"] if inv.expert_fp8 else 0.0
    fp8_s = dense + experts + compute.get("expert_fp8_casts", 0.0)
    bf16_s = dense * fp8 + experts * gpu.fp8_speedup_grouped
    rest = sum(compute.values()) - fp8_s
    bf16_step = step_of(rest + bf16_s)
    out = {"converted_s": fp8_s, "converted_bf16_s": bf16_s, "share_of_bf16_step": bf16_s / bf16_step,
           "speedup": bf16_step / step_of(rest + fp8_s), "speedup_at_2x": bf16_step / step_of(rest + bf16_s / 2),
           "speedup_if_free": bf16_step / step_of(rest)}
    if inv.expert_fp8:
        out["experts_net_s"] = experts + compute.get("expert_fp8_casts", 0.0) - experts * gpu.fp8_speedup_grouped
    return out


def plan_time(inv: ModelInventory, layout: Layout, gpu: GpuSpec, ctx: ActContext, *, regime: str, with_mtp: bool,
              param_bytes: int, reduce_bytes: int, seq_len: int, local_batch: int, train: bool = True,
              micro: int = 1) -> TimePlan:
    compute = compute_terms(inv, gpu, ctx, regime=regime, with_mtp=with_mtp, layout=layout, train=train, micro=micro)
    fsdp = fsdp_collectives(inv, layout, gpu, param_bytes=param_bytes, reduce_bytes=reduce_bytes, with_mtp=with_mtp)
    others = other_collectives(inv, layout, gpu, ctx, regime=regime, with_mtp=with_mtp)
    units = [u for u in inv.units if u.name in fsdp]
    first_gather = min((c.seconds for c in fsdp.get("embed_tokens", []) if "all-gather" in c.name), default=0.0)
    moved = offloaded_inputs(inv.units, ctx, with_mtp=with_mtp) if ctx.offload_inputs else 0.0

    def exposed_by(total_compute: float) -> dict[str, float]:
        """Communication not hidden behind `total_compute` seconds of compute, by kind."""
        # FSDP: each unit's collectives overlap the compute of one unit (its neighbour); compute is spread over units
        # in proportion to their parameters' FLOPs, approximated here by an even split over the compute-bearing units.
        per_unit = total_compute / max(1, len(units))
        exposed_fsdp = sum(max(0.0, sum(c.seconds for c in fsdp[u.name] if c.overlapped) - per_unit) for u in units)
        exposed = {"fsdp": exposed_fsdp + first_gather}
        # the experts' own gathers and reduce-scatters (expert_fsdp) run inside their op: all exposed
        for c in [c for cs in fsdp.values() for c in cs if not c.overlapped] + others:
            exposed[c.name] = exposed.get(c.name, 0.0) + c.seconds
        if ctx.offload_inputs:  # copies back on the compute stream, not prefetched: exposed (the copies out overlap)
            exposed["offloaded block inputs, host to device"] = moved / gpu.host_link
        return {k: v * micro for k, v in exposed.items()}  # per microbatch (deferred reduces: one rank, none)

    total_compute = sum(compute.values())
    exposed = exposed_by(total_compute)
    step = total_compute + sum(exposed.values())
    tokens = layout.dp * local_batch * seq_len * micro
    tps = tokens / step
    per_gpu = tps / layout.gpus
    fpt = flops_per_token(inv.args if with_mtp else inv.args.replace(num_nextn_predict_layers=0), seq_len)
    mfu = per_gpu * fpt / gpu.peak_bf16
    colls = [c for cs in fsdp.values() for c in cs] + others
    fp8 = fp8_bound(compute, inv, gpu, lambda total: total + sum(exposed_by(total).values()))
    return TimePlan(step, compute, exposed, colls, tokens, tps, per_gpu, fpt, mfu, micro, fp8)
