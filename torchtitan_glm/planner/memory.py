"""Peak device memory of one training step on one rank: the step is walked block by block (forward, loss, backward,
gradient reduction) and the live bytes are added up at every point; the plan reports the largest sum and what it
was made of.

What is live (allocated bytes, not the allocator's reserve):
- training (`train.py`): FP32 parameter shards and AdamW states all step; gradients appear unit by unit in the
  backward (FSDP2 reduce-scatters each unit's BF16 gradients through an FP32 buffer of the unit's unsharded size
  into the FP32 shard); each unit's parameters are all-gathered in the compute dtype while it runs, with the next unit
  prefetched (the final-norm + LM-head unit stays gathered from the final norm to its backward, as parallelize.py
  sets it); the FP32-kept parameters' gradients are concatenated for one all-reduce after the backward.
- benchmark (`scripts/benchmark.py`): every parameter in BF16, no optimizer, no FSDP; BF16 gradients accumulate.
Activations are the blocks' kept tensors (activations.py) plus the working set of the block running; the fused
LM-head CE keeps its FP32 [vocab, D] weight gradient and the hidden-state gradient from its forward to its
backward and needs per chunk the logits and their gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .activations import ActContext, backward_work, forward_work, saved
from .layout import Layout
from .model import ModelInventory, Unit
from .params import StateBytes, outside, outside_unit_bytes, shard_of, state_bytes, trainable_unit_bytes, unit_bytes

SCOPES = ("train", "bench_train", "bench_reference")
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "fsdp_buffers", "working", "loss")


@dataclass(frozen=True)
class StepSetup:
    """What the step runs: scope, AC regime, dtypes in bytes, the loss's chunk."""

    scope: str
    regime: str  # eager | compiled | selective | full
    param_bytes: int = 2  # compute dtype of parameters/activations (training.mixed_precision_param)
    reduce_bytes: int = 4  # gradient reduce dtype (training.mixed_precision_reduce)
    ce_chunk: int = 4096
    compiled_loss: bool = True
    accumulated: bool = False  # training.global_batch_size > local x dp: a later microbatch is walked (see plan_memory)
    grads_in_compute_pool: bool = False  # parallelism.fsdp_reduce_in_compute_pool, where it applies (see plan_memory)


@dataclass
class MemoryPlan:
    peak: float  # allocated bytes at the step's largest point
    peak_at: str
    reserved: float  # estimate of the allocator's reserve (see plan_memory)
    reserved_at: str
    breakdown: dict[str, float]
    activations_by_type: dict[str, float]
    activation_terms: dict[str, float]
    state: StateBytes | None
    ce_chunk_working: float = 0.0  # the fused CE's per-chunk working set (logits and their gradient, dW partial)
    timeline: list[tuple[str, float]] = field(default_factory=list)
    host_pinned: float = 0.0  # bytes of pinned host memory (activation_checkpoint.offload_inputs), not on the GPU


class _Walk:
    def __init__(self) -> None:
        self.live = dict.fromkeys(CATEGORIES, 0.0)
        self.peak, self.peak_at, self.breakdown = -1.0, "", {}
        self.cached = 0.0  # freed bytes the allocator keeps in other streams' pools (see plan_memory)
        self.reserved, self.reserved_at = -1.0, ""
        self.timeline: list[tuple[str, float]] = []

    def point(self, label: str, **extra: float) -> None:
        now = dict(self.live)
        for k, v in extra.items():
            now[k] += v
        total = sum(now.values())
        self.timeline.append((label, total))
        if total > self.peak:
            self.peak, self.peak_at, self.breakdown = total, label, now
        if total + self.cached > self.reserved:
            self.reserved, self.reserved_at = total + self.cached, label


def _tokens_bytes(ctx: ActContext, per_token: float) -> float:
    return per_token * ctx.tokens / ctx.tp


def plan_memory(inv: ModelInventory, layout: Layout, ctx: ActContext, setup: StepSetup) -> MemoryPlan:
    """Walk one step of `setup.scope` for the rank described by `ctx` under `layout`.

    The reserve estimate adds what the CUDA caching allocator holds but cannot hand to the compute stream: FSDP2
    allocates the sharded gradients on its reduce-scatter stream and the all-gather buffers on its all-gather stream;
    blocks freed there stay cached in those streams' pools. So the previous step's gradients (freed by zero_grad)
    stay reserved through the next forward until the backward's reduce-scatters reuse them, and two units' all-gather
    buffers stay reserved all step.

    Under gradient accumulation (`setup.accumulated`) the walk is of a microbatch after the first: every gradient the
    step accumulates is live from its start (FP32: sharded, or, where gradient_accumulation.py defers FSDP2's reduce,
    unsharded in the reduce dtype, the same bytes on one rank), and each unit's reduce adds into it. A deferred
    reduce keeps both in the reserve: the unsharded gradients in the compute stream's pool, the sharded ones (freed
    by zero_grad) in the reduce-scatter stream's. With `grads_in_compute_pool` (distributed/fsdp_comms.py) the sharded
    gradients come from the compute stream's pool too: freed, they are reused there, and none stay apart."""
    if setup.scope not in SCOPES:
        raise ValueError(f"unknown scope {setup.scope!r}; choose from {SCOPES}")
    args, a = inv.args, ctx.act
    train = setup.scope == "train"
    with_mtp = setup.scope != "bench_reference" and any(u.kind == "mtp" for u in inv.units)
    d, vocab = args.hidden_size, args.vocab_size
    w = _Walk()
    state = None
    if train:
        state = state_bytes(inv, layout)
        w.live["parameters"] = state.params + inv.buffer_bytes
        w.live["optimizer"] = state.optimizer
        gathered_max = max(unit_bytes(u, layout, dtype_bytes=setup.param_bytes, sharded=False) for u in inv.units)
        apart = 0 if setup.grads_in_compute_pool else state.grads - state.replicated_grads
        w.cached = apart + 2 * gathered_max
        if setup.accumulated:
            w.live["gradients"] = state.grads
            # a deferred reduce accumulates the unsharded gradients on the compute stream and writes the sharded
            # ones on the reduce-scatter stream, once per step: the previous step's stay cached in that pool
            w.cached = 2 * gathered_max + (apart if layout.reduce_deferred else 0)
    else:
        w.live["parameters"] = sum(p.numel for p in inv.params) * a + inv.buffer_bytes

    units = {u.name: u for u in inv.units}
    trunk = [u for u in inv.units if u.kind not in ("head", "mtp")]
    order = trunk + ([units["mtp"]] if with_mtp else [])

    def gathered(u: Unit | None) -> float:
        return unit_bytes(u, layout, dtype_bytes=setup.param_bytes, sharded=False) if (train and u) else 0.0

    def transient(u: Unit | None) -> float:
        """A unit's gathered parameters while it (or its prefetch) runs; a unit that does not reshard after forward
        (parallelism.fsdp_reshard_after_forward) holds them from its forward to its backward instead."""
        return gathered(u) if (u is None or u.reshard_after_forward) else 0.0

    def expert_cast(u: Unit) -> float:
        """Expert parallelism: the rank's experts (out of FSDP2) are cast to the compute dtype inside the MoE op."""
        if not train or layout.ep == 1:
            return 0.0
        return sum(shard_of(p, layout).padded for p in u.params if p.expert) * setup.param_bytes

    kept: dict[str, float] = {}
    by_type: dict[str, float] = {}
    terms: dict[str, float] = {}

    def block_saved(u: Unit) -> float:
        if u.kind == "embed":
            return _tokens_bytes(ctx, 8)  # token ids
        parts = saved(u.kind, setup.regime, ctx, shared_indexer=u.shared_indexer)
        for k, v in parts.items():
            terms[k] = terms.get(k, 0.0) + v
        return sum(parts.values())

    def fwd_work(u: Unit) -> float:
        if u.kind == "embed":
            return _tokens_bytes(ctx, d * a + args.hc_mult * d * a)  # embeddings, the streams copy
        return forward_work(u.kind, setup.regime, ctx, shared_indexer=u.shared_indexer)

    head = units["head"]
    # ------------------------------------------------------------------------------------------ forward
    for i, u in enumerate(order):
        if u.kind == "mtp":  # after the trunk: the final norm (eager, FP32) and its output
            final_norm = _tokens_bytes(ctx, 4 * d + 4 + d * a + d * a)
            w.live["activations"] += final_norm
            kept["final_norm"] = final_norm
            w.live["fsdp_buffers"] += gathered(head)
        nxt = order[i + 1] if i + 1 < len(order) else None
        s = block_saved(u)
        if not u.reshard_after_forward:  # gathered now, freed after its backward
            w.live["fsdp_buffers"] += gathered(u)
        w.point(f"forward {u.name}", activations=s, working=fwd_work(u) + expert_cast(u),
                fsdp_buffers=transient(u) + gathered(nxt))  # the next unit's prefetch is not held yet
        w.live["activations"] += s
        kept[u.name] = s
        if u.kind != "embed":
            by_type[u.kind] = by_type.get(u.kind, 0.0) + s
    if not with_mtp:
        final_norm = _tokens_bytes(ctx, 4 * d + 4 + d * a + d * a)
        w.live["activations"] += final_norm
        kept["final_norm"] = final_norm
        w.live["fsdp_buffers"] += gathered(head)
    by_type["final_norm"] = kept["final_norm"]

    # the fused LM-head CE over trunk (+ MTP) rows
    rows = ctx.tokens // ctx.tp * (2 if with_mtp else 1)
    chunk = min(setup.ce_chunk, rows)
    v_local = vocab // ctx.tp if ctx.tp > 1 else vocab
    several = rows > chunk  # one chunk writes grad_w in the weight's dtype; several sum it in FP32
    gw = 4 if several else a
    ce_kept = rows * d * a + gw * v_local * d  # grad_h, grad_w
    if setup.compiled_loss:  # per chunk: the logits GEMM output with the gradient written from it in the weight's
        # dtype (the FP32 upcast fused away); then that gradient with the dW partial
        ce_work = max(2 * chunk * v_local * a, chunk * v_local * a + v_local * d * a)
    else:  # eager: the FP32 logits (modified in place) stay referenced through the chunk, with the cast, the dW
        # partial and (several chunks) its FP32 copy
        ce_work = chunk * v_local * (4 + a) + v_local * d * (a + (4 if several else 0))
    w.point("forward loss (fused CE)", loss=ce_kept + ce_work + rows * d * a)
    w.live["loss"] += ce_kept
    by_type["lm_head_ce"] = ce_kept

    # ----------------------------------------------------------------------------------------- backward
    ce_bwd = rows * d * a + v_local * d * a + (0 if setup.compiled_loss else gw * v_local * d)
    head_grad = _unsharded_grads(head, layout, setup, train, a)
    w.point("backward loss (fused CE)", working=ce_bwd, gradients=head_grad)
    w.live["loss"] -= ce_kept
    w.live["gradients"] += head_grad  # the LM head's gradient (unsharded until the unit reduces)

    def finish_head() -> None:  # the final norm's backward completes the head unit's gradients
        w.live["activations"] -= kept["final_norm"]
        if train:
            w.live["gradients"] -= head_grad
            w.live["fsdp_buffers"] -= gathered(head)
            _reduce(w, head, layout, setup, head_grad, "reduce-scatter head")

    if not with_mtp:
        finish_head()
    backward = list(reversed(order))
    for i, u in enumerate(backward):
        before = backward[i + 1] if i + 1 < len(backward) else None
        grads = _unsharded_grads(u, layout, setup, train, a)
        work = 0.0 if u.kind == "embed" else backward_work(u.kind, setup.regime, ctx,
                                                             shared_indexer=u.shared_indexer)
        w.point(f"backward {u.name}", working=work + expert_cast(u), gradients=grads,
                fsdp_buffers=transient(u) + transient(before))
        w.live["activations"] -= kept[u.name]
        if not u.reshard_after_forward:
            w.live["fsdp_buffers"] -= gathered(u)
        if train:
            _reduce(w, u, layout, setup, grads, f"reduce-scatter {u.name}")
        else:
            w.live["gradients"] += grads
        if u.kind == "mtp":
            finish_head()
    if train:  # one flat FP32 copy per replica group (parallelize.Replicated): the experts' (EP), or the FP32-kept
        experts = sum(outside_unit_bytes(Unit(u.name, u.kind, tuple(p for p in u.params if p.expert), True),
                                         layout, trainable_only=True) for u in inv.units)
        w.point("all-reduce of the replicated gradients", working=max(experts, state.replicated_grads - experts))
    return MemoryPlan(w.peak, w.peak_at, w.reserved, w.reserved_at, w.breakdown, by_type, terms, state, ce_work,
                      w.timeline)


def _unsharded_grads(u: Unit, layout: Layout, setup: StepSetup, train: bool, act: int) -> float:
    """A unit's gradients as its backward produces them: the compute dtype, unsharded (training: FSDP-managed, and the
    parameters kept out of FSDP2 in their own dtype; benchmark: every parameter in BF16)."""
    if train:
        rep = outside_unit_bytes(u, layout, trainable_only=True)
        return trainable_unit_bytes(u, layout, dtype_bytes=setup.param_bytes) + rep
    return sum(p.numel for p in (*u.params, *u.replicated)) * act


def _reduce(w: _Walk, u: Unit, layout: Layout, setup: StepSetup, grads: float, label: str) -> float:
    """FSDP2's post-backward of a unit: copy the gradients into an FP32 reduce-scatter buffer of the unit's unsharded
    size, free them, keep the sharded FP32 result (plus the FP32-kept gradients, whole)."""
    rs_in = trainable_unit_bytes(u, layout, dtype_bytes=setup.reduce_bytes)
    sharded = sum(p.dtype_bytes * _padded(p, layout) for p in u.params if p.trainable and not outside(p, layout))
    rep = outside_unit_bytes(u, layout, trainable_only=True)
    w.point(label, gradients=grads + sharded, working=rs_in)
    if not setup.accumulated:  # else added into the gradients held since the first microbatch
        w.live["gradients"] += sharded + rep
    if not setup.grads_in_compute_pool:  # the reduce-scatter output reuses the cached gradient blocks
        w.cached = max(0.0, w.cached - sharded)
    return rs_in


def _padded(p, layout: Layout) -> int:
    return shard_of(p, layout).padded
