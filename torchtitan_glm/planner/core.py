"""One plan (a layout of a config on N GPUs: memory, FLOPs, communication, step time) and the layout search.

A plan is built from the trainer's own config (`load_config`), model (`build_model_args`, `Glm5Model` on meta,
`convert_float8`), FSDP2 units and FP32-kept parameters (parallelize.py), FLOP count (`metrics.flops_per_token`)
and layout validation (`layout.trainer_verdict`). Scopes: `train` (train.py: FSDP2, AdamW, mixed precision),
`bench_train` and `bench_reference` (scripts/benchmark.py's training and reference scopes: one device, BF16 weights,
no optimizer, no FSDP), so every measured figure has a plan to compare with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torchtitan_glm.components.cuda_alloc import memory_limit_error
from torchtitan_glm.config import ConfigError, JobConfig, load_config
from torchtitan_glm.distributed.fsdp_comms import compute_pool_wanted

from .activations import ActContext, offloaded_inputs
from .hardware import GIB, GpuSpec
from .layout import NEUTRAL_DATA, Layout, Verdict, candidate_layouts, describable, resolve_layout, \
    split_layout_args, trainer_verdict
from .memory import MemoryPlan, StepSetup, plan_memory
from .model import ModelInventory, build_meta_model, inventory
from .timing import TimePlan, plan_time

SCHEMA = "torchtitan_glm.plan/1"
SEARCH_SCHEMA = "torchtitan_glm.plan_search/1"
MEMORY_BUDGET = 0.90  # a plan fits when its reserve estimate is within this share of the card

# The JSON of one plan (`Plan.to_json`, `scripts/plan.py --json`): field -> (type, meaning). Stable within SCHEMA;
# tests/unit/test_plan_script.py checks it. Bytes are per GPU; GiB values are rounded to 1/1000.
PLAN_FIELDS = {
    "schema": (str, "SCHEMA"),
    "argv": (list, "the train.py arguments planned"),
    "scope": (str, "train | bench_train | bench_reference"),
    "gpu": (str, "GPU model"),
    "gpus": (int, "world size"),
    "layout": (dict, "dp_replicate, dp_shard, tp, ep, cp, expert_fsdp"),
    "trainer_accepts": (bool, "whether train.py accepts the layout today"),
    "trainer_message": ((str, type(None)), "the trainer's error for a rejected layout"),
    "design": (str, "'parallelize.py' or what the what-if assumes instead"),
    "seq_len": (int, "tokens per row"),
    "local_batch_size": (int, "rows per data-parallel rank"),
    "microbatches": (int, "microbatches accumulated per optimizer step (training.global_batch_size)"),
    "tokens_per_step": (int, "global tokens per optimizer step"),
    "activation_checkpoint": (str, "none | selective | full"),
    "regime": (str, "eager | compiled | selective | full"),
    "float8": (str, "the trainer's float8 start-up line"),
    "memory": (dict, "MEMORY_FIELDS"),
    "time": (dict, "TIME_FIELDS"),
    "collectives": (list, "one entry per unit and collective: name, group, calls, bytes_per_rank, link, seconds, "
                          "overlapped"),
    "assumptions": (list, "every assumption of the plan, as text"),
}
MEMORY_FIELDS = {
    "peak_gib": (float, "largest allocated sum of the step"), "peak_at": (str, "where in the step"),
    "reserved_gib": (float, "estimate of the allocator's reserve"), "reserved_at": (str, "where in the step"),
    "capacity_gib": (float, "the card"),
    "budget_gib": (float, "MEMORY_BUDGET of the card, or training.device_memory_limit_gib if lower"),
    "fits": (bool, "max(peak, reserved) <= budget"),
    "breakdown_gib": (dict, "at the peak: parameters, gradients, optimizer, activations, fsdp_buffers, working, loss"),
    "activations_by_layer_type_gib": (dict, "kept activations summed per layer type (+ final_norm, lm_head_ce)"),
    "activation_terms_gib": (dict, "kept activations summed per term (streams, mhc, kda, mla, attention, ...)"),
    "ce_chunk_working_gib": (float, "the fused CE's per-chunk working set (logits, their gradient, dW partial)"),
    "host_pinned_gib": (float, "pinned host memory per rank: activation_checkpoint.offload_inputs' block inputs"),
    "state_bytes": ((dict, type(None)), "train scope: params, grads, optimizer and their replicated parts"),
}
TIME_FIELDS = {
    "step_s": (float, "estimated step time"), "tokens_per_s": (float, "global"),
    "tokens_per_s_per_gpu": (float, "per GPU"), "flops_per_token": (float, "metrics.flops_per_token"),
    "mfu": ((float, type(None)), "model FLOPs utilisation of the dense BF16 peak"),
    "compute_s": (dict, "compute seconds by term"), "exposed_comm_s": (dict, "communication not hidden, by kind"),
    "fp8": ((dict, type(None)), "with FP8: the converted GEMMs' seconds (converted_s, converted_bf16_s), their "
                                "share_of_bf16_step, and the step's speed-up over BF16: speedup (planned), "
                                "speedup_at_2x (those GEMMs at twice the BF16 rate), speedup_if_free; with FP8 "
                                "routed experts experts_net_s (their seconds with the casts less in BF16)"),
}
_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


class PlanError(ValueError):
    """A request the planner cannot answer (not a trainer config error)."""


@dataclass(frozen=True)
class Request:
    """What to plan: train.py's arguments (config and overrides), GPUs, the GPU model, the scope."""

    argv: tuple[str, ...]
    gpus: int
    gpu: GpuSpec
    scope: str = "train"
    what_if: bool = False  # plan layouts the trainer does not accept yet (marked with its message)


@dataclass
class Plan:
    request: Request
    cfg: JobConfig
    layout: Layout
    verdict: Verdict
    regime: str
    memory: MemoryPlan
    time: TimePlan
    float8_line: str

    @property
    def design(self) -> str:
        """What parallelisation the plan assumes: the trainer's, or a what-if."""
        return "parallelize.py" if self.verdict.accepted else "what-if: a layout the trainer rejects today"

    @property
    def budget(self) -> float:
        """MEMORY_BUDGET of the card, or training.device_memory_limit_gib where that is set and lower."""
        card = MEMORY_BUDGET * self.request.gpu.memory_bytes
        limit = self.cfg.training.device_memory_limit_gib * 2**30
        return min(card, limit) if limit else card

    @property
    def fits(self) -> bool:
        return max(self.memory.peak, self.memory.reserved) <= self.budget

    def to_json(self) -> dict:
        m, t, cfg = self.memory, self.time, self.cfg
        gib = lambda x: round(x / GIB, 3)  # noqa: E731
        state = None
        if m.state is not None:
            state = {k: getattr(m.state, k) for k in ("params", "grads", "optimizer", "replicated_params",
                                                     "replicated_grads", "replicated_optimizer")}
        return {
            "schema": SCHEMA,
            "argv": list(self.request.argv),
            "scope": self.request.scope,
            "gpu": self.request.gpu.name,
            "gpus": self.request.gpus,
            "layout": self.layout.as_dict(),
            "trainer_accepts": self.verdict.accepted,
            "trainer_message": self.verdict.message,
            "design": self.design,
            "seq_len": cfg.training.seq_len,
            "local_batch_size": cfg.training.local_batch_size,
            "microbatches": t.micro,
            "tokens_per_step": t.tokens_per_step,
            "activation_checkpoint": cfg.activation_checkpoint.mode,
            "regime": self.regime,
            "float8": self.float8_line,
            "memory": {
                "peak_gib": gib(m.peak), "peak_at": m.peak_at, "reserved_gib": gib(m.reserved),
                "reserved_at": m.reserved_at, "capacity_gib": gib(self.request.gpu.memory_bytes),
                "budget_gib": gib(self.budget), "fits": self.fits,
                "breakdown_gib": {k: gib(v) for k, v in m.breakdown.items()},
                "activations_by_layer_type_gib": {k: gib(v) for k, v in m.activations_by_type.items()},
                "activation_terms_gib": {k: gib(v) for k, v in sorted(m.activation_terms.items())},
                "ce_chunk_working_gib": gib(m.ce_chunk_working),
                "host_pinned_gib": gib(m.host_pinned),
                "state_bytes": state,
            },
            "time": {
                "step_s": round(t.step_s, 5), "tokens_per_s": round(t.tokens_per_s, 1),
                "tokens_per_s_per_gpu": round(t.tokens_per_s_per_gpu, 1), "flops_per_token": t.flops_per_token,
                "mfu": round(t.mfu, 4) if t.mfu is not None else None,
                "compute_s": {k: round(v, 5) for k, v in t.compute_s.items()},
                "exposed_comm_s": {k: round(v, 5) for k, v in t.exposed_comm_s.items()},
                "fp8": {k: round(v, 5) for k, v in t.fp8.items()} if t.fp8 else None,
            },
            "collectives": [dataclasses.asdict(c) for c in t.collectives],
            "assumptions": assumptions(self.request.gpu),
        }


def assumptions(gpu: GpuSpec) -> list[str]:
    return [
        *gpu.assumptions(),
        "memory: allocated bytes walked block by block; the reserve adds the caching allocator's per-stream pools "
        "(FSDP2's reduce-scatter outputs and all-gather buffers); a plan fits when the larger of the two is within "
        f"{MEMORY_BUDGET:.0%} of the card, or within training.device_memory_limit_gib where that is lower",
        "activations: per-block inventories checked against saved-tensor captures on CPU (the same kernels' tensors "
        "on CUDA, plus FLA's KDA residuals); tensor parallelism (no sequence parallelism) divides the split heads' "
        "and columns' terms by tp",
        "DSA: absorbed sparse MLA over index_topk + kpool - 1 tokens, or masked SDPA for the dense stage and rows of "
        "at most dsa_dense_max_len tokens (with data.document_masking false and no CP, the rows whose mask is plain "
        "causal run the causal kernel with no mask); the indexer's tiled top-k and KL in FP32",
        "expert load balanced (each rank's experts receive tokens x top-k rows); FSDP collectives hidden behind one "
        "neighbouring unit's compute; EP all-to-all, TP, CP, the routed experts' gathers and reduce-scatters inside "
        "their op (expert_fsdp) and the out-of-FSDP gradient all-reduces not hidden",
        "context parallelism as the trainer runs it: each rank computes seq_len / cp tokens of every row (zigzag); DSA "
        "keeps the all-gathered latent, pools the whole rows and runs the indexer KL per zigzag chunk (checked against "
        "2-rank gloo captures, eager and full AC); KDA chains its states through FLA's CP all-gathers (compute at "
        "the single-rank FLA rate: the CP pre-pass is not timed); selective AC saves the CP KDA op's outputs "
        "(kda_cp_fwd) and recomputes the conv-halo and DSA all-gathers",
    ]


def regime_of(cfg: JobConfig) -> str:
    mode = cfg.activation_checkpoint.mode
    if mode in ("full", "selective"):
        return mode
    return "compiled" if cfg.compile.enable and "model" in cfg.compile.components else "eager"


def load_request(request: Request) -> tuple[JobConfig, dict[str, int], list[str]]:
    """The trainer's config for the request (layout keys read aside, data neutralised) and the layout fields."""
    fields, rest = split_layout_args(list(request.argv))
    cfg = load_config([*rest, *NEUTRAL_DATA])
    return cfg, fields, rest


def build_inventory(cfg: JobConfig, *, scope: str) -> ModelInventory:
    """The model a scope runs: the trainer's, or (bench_reference) the trainer's without the MTP layer."""
    from torchtitan_glm.train import build_model_args

    args = build_model_args(cfg)
    if scope == "bench_reference":
        args = args.replace(num_nextn_predict_layers=0)
    if cfg.optimizer.cpu_offload:
        raise PlanError("optimizer.cpu_offload: the planner does not model host-resident parameters, gradients and "
                        "optimizer states; plan without it")
    model, line = build_meta_model(cfg, args=args)
    inv = inventory(model, line, recipe=cfg.float8.recipe if cfg.float8.enable else None,
                    fsdp_reshard=cfg.parallelism.fsdp_reshard_after_forward)
    from torchtitan_glm.components.optimizer import resolved_implementation

    return dataclasses.replace(inv, optimizer=cfg.optimizer.name,
                               optimizer_implementation=resolved_implementation(cfg.optimizer, on_cuda=True))


def plan_layout(request: Request, cfg: JobConfig, inv: ModelInventory, layout: Layout, verdict: Verdict,
                *, regime: str | None = None, local_batch: int | None = None) -> Plan:
    """Memory and time of one layout (already validated or marked by `verdict`), optionally with another AC regime
    or local batch than the config's."""
    if local_batch is not None:
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, local_batch_size=local_batch))
    if regime is not None:
        ac = {"compiled": "none", "eager": "none"}.get(regime, regime)
        cfg = dataclasses.replace(cfg, activation_checkpoint=dataclasses.replace(cfg.activation_checkpoint, mode=ac))
    regime = regime_of(cfg)
    scope = request.scope
    tr = cfg.training
    if tr.seq_len % layout.cp:
        raise PlanError(f"training.seq_len={tr.seq_len} does not divide into context_parallel_degree={layout.cp}")
    act = _DTYPE_BYTES[tr.mixed_precision_param]
    with_mtp = scope != "bench_reference" and inv.args.num_nextn_predict_layers > 0
    collect = scope == "bench_train" or (scope == "train" and cfg.loss.indexer_kl_coeff > 0
                                        and inv.args.num_dsa_layers > 0)
    ctx = ActContext(args=inv.args, batch=tr.local_batch_size, seq=tr.seq_len // layout.cp, keys=tr.seq_len,
                     act=act, tp=layout.tp, device="cuda", fp32_params=scope == "train", collect_stats=collect,
                     sparse_kl=cfg.loss.indexer_sparse_loss, cp=layout.cp,
                     moe_chunk=cfg.activation_checkpoint.moe_chunk_tokens,
                     offload_inputs=cfg.activation_checkpoint.offload_inputs and regime == "full",
                     recompute=tuple(cfg.activation_checkpoint.recompute_modules) if regime == "selective" else (),
                     compiled=cfg.compile.enable and "model" in cfg.compile.components,
                     document_masking=cfg.data.document_masking or layout.cp > 1,
                     kda_saved_states=cfg.activation_checkpoint.kda_disable_recompute)
    compiled_loss = cfg.compile.enable and "loss" in cfg.compile.components
    try:
        micro = tr.accumulation_steps(layout.dp) if scope == "train" else 1
    except ConfigError as e:
        raise PlanError(str(e)) from e
    # the compute-pool reduce applies only where no parameter is split over ranks (layout.reduce_deferred); train.py
    # refuses fsdp_reduce_in_compute_pool = true elsewhere, so no plan counts it there
    in_pool = layout.reduce_deferred and compute_pool_wanted(cfg.parallelism.fsdp_reduce_in_compute_pool,
                                                             splits_parameters=False,
                                                             cpu_offload=cfg.optimizer.cpu_offload)
    setup = StepSetup(scope=scope, regime=regime, param_bytes=act,
                      reduce_bytes=_DTYPE_BYTES[tr.mixed_precision_reduce], ce_chunk=cfg.loss.ce_chunk_size,
                      compiled_loss=compiled_loss, accumulated=micro > 1, grads_in_compute_pool=in_pool)
    memory = plan_memory(inv, layout, ctx, setup)
    memory.host_pinned = offloaded_inputs(inv.units, ctx, with_mtp=with_mtp)
    time = plan_time(inv, layout, request.gpu, ctx, regime=regime, with_mtp=with_mtp, param_bytes=act,
                     reduce_bytes=setup.reduce_bytes, seq_len=tr.seq_len, local_batch=tr.local_batch_size,
                     train=scope == "train", micro=micro)
    return Plan(request, cfg, layout, verdict, regime, memory, time, inv.float8_line)


def _check_memory_limit(cfg: JobConfig, gpu: GpuSpec) -> None:
    """train.py refuses a training.device_memory_limit_gib above the card (exit 2 naming the key); so does the plan."""
    why = memory_limit_error(cfg.training.device_memory_limit_gib, total_bytes=gpu.memory_bytes)
    if why:
        raise ConfigError("training.device_memory_limit_gib", f"{why} ({gpu.name})")


def plan(request: Request) -> Plan:
    """Plan the layout the request's arguments state (the config's [parallelism] plus `--parallelism.*` overrides).

    A layout the trainer rejects raises its ConfigError (same message, exit 2 from the script), unless `what_if`."""
    cfg, fields, rest = load_request(request)
    _check_memory_limit(cfg, request.gpu)
    if request.scope != "train":
        if request.gpus != 1:
            raise PlanError(f"scope {request.scope!r} is scripts/benchmark.py on one device; got --gpus {request.gpus}")
        layout, verdict = Layout(), Verdict(True)
    else:
        layout = resolve_layout(fields, gpus=request.gpus, config=cfg.parallelism)
        verdict = trainer_verdict(rest, layout, gpus=request.gpus, explicit_shard="dp_shard" in fields)
        if not verdict.accepted and not request.what_if:
            raise verdict.error
        if layout.gpus != request.gpus:  # --what-if cannot plan it either: the trainer's reason, if it gave one
            if verdict.error is not None:
                raise verdict.error
            raise PlanError(f"the layout {layout.describe()} uses {layout.gpus} GPUs, not --gpus {request.gpus}")
    inv = build_inventory(cfg, scope=request.scope)
    if request.scope == "train":
        why = describable(layout, args=inv.args, seq_len=cfg.training.seq_len,
                          gpus_per_node=request.gpu.gpus_per_node)
        if why is not None:
            raise PlanError(f"the planner cannot describe {layout.describe()}: {why}")
    return plan_layout(request, cfg, inv, layout, verdict)


def search(request: Request, *, top: int = 5, regimes: tuple[str, ...] | None = None,
           local_batches: tuple[int, ...] | None = None) -> dict:
    """Every layout of `request.gpus` GPUs the cost model describes, with each AC regime in `regimes` and local batch
    in `local_batches` (default: the config's), planned; those that fit ranked by tokens/s. Layouts the trainer
    rejects are skipped unless `what_if` (then planned and marked with its message)."""
    cfg, _, rest = load_request(request)
    _check_memory_limit(cfg, request.gpu)
    inv = build_inventory(cfg, scope="train")
    cands = candidate_layouts(request.gpus, args=inv.args, seq_len=cfg.training.seq_len,
                              gpus_per_node=request.gpu.gpus_per_node)
    regimes = regimes or (regime_of(cfg),)
    plans, rejected = [], {}
    for layout in cands:
        layout = dataclasses.replace(layout, expert_fsdp=cfg.parallelism.expert_fsdp)
        verdict = trainer_verdict(rest, layout, gpus=request.gpus)
        if not verdict.accepted:
            rejected[layout.describe()] = verdict.message
            if not request.what_if:
                continue
        for regime in regimes:
            for batch in local_batches or (cfg.training.local_batch_size,):
                plans.append(plan_layout(request, cfg, inv, layout, verdict, regime=regime, local_batch=batch))
    fitting = sorted((p for p in plans if p.fits), key=lambda p: -p.time.tokens_per_s)
    return {"inventory": inv, "plans": plans, "fitting": fitting, "top": fitting[:top], "candidates": len(cands),
            "rejected": rejected, "memory_limit_gib": cfg.training.device_memory_limit_gib}
