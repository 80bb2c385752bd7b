"""Communication of one training step per rank, per collective: bytes each rank sends over the group's links and the
time at the group's bus bandwidth (NVLink when the group fits in a node, InfiniBand otherwise).

Ring collectives over g ranks move (g - 1) / g of the full tensor per rank (all-gather, reduce-scatter; twice that
for all-reduce); an all-to-all sends (g - 1) / g of the rank's rows. The mesh is TorchTitan's (dp_replicate,
dp_shard, cp, tp) with tp innermost, so a group's span in consecutive ranks is tp (TP), cp x tp (CP), ep x tp (EP),
dp_shard x cp x tp (FSDP) and the world (HSDP replicas, the expert-data group).

What parallelize.py runs: FSDP2 over dp_shard x cp for every parameter it manages (all-gather forward and, for the
units resharded after forward, backward; reduce-scatter of the gradients; HSDP all-reduce over dp_replicate); the
parameters it keeps out (FP32-kept ones; the routed experts under EP) have their gradients all-reduced after the
backward, the FP32-kept over the data ranks, the experts over the ranks holding the same experts; tensor parallelism
without sequence parallelism all-reduces the row-parallel outputs (attention, MLP) in forward and the column-parallel
inputs' gradients in backward, plus the replicated MLA latent's gradient; expert parallelism dispatches and combines
with all-to-alls (ops/expert_parallel.py: 2 forward, 3 backward as it recomputes the dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass

from .activations import ActContext
from .hardware import GpuSpec
from .layout import Layout
from .model import ModelInventory, Unit
from .params import outside_unit_bytes, state_bytes, trainable_unit_bytes, unit_bytes


@dataclass(frozen=True)
class Collective:
    """One kind of collective over a step: how often it runs, the bytes per rank over all runs, its link, its time."""

    name: str
    group: int
    calls: int
    bytes_per_rank: float
    link: str
    seconds: float
    overlapped: bool  # runs on a side stream behind compute (FSDP prefetch / reduce-scatter)


def _link(span: int, gpu: GpuSpec) -> tuple[str, float]:
    return ("nvlink", gpu.nvlink_busbw) if span <= gpu.gpus_per_node else ("infiniband", gpu.ib_busbw)


def _coll(name: str, group: int, calls: int, full_bytes: float, span: int, gpu: GpuSpec, *, factor: float = 1.0,
          overlapped: bool = False, a2a: bool = False) -> Collective | None:
    if group <= 1 or calls == 0 or full_bytes <= 0:
        return None
    link, bw = _link(span, gpu)
    per_rank = factor * (group - 1) / group * full_bytes
    seconds = per_rank / bw
    if a2a:  # peers in the rank's node over NVLink, the others over InfiniBand, both at once
        local = max(1, min(group, gpu.gpus_per_node * group // max(span, 1)))
        intra = per_rank * (local - 1) / (group - 1)
        seconds = max(intra / gpu.nvlink_busbw, (per_rank - intra) / gpu.ib_busbw) / gpu.a2a_efficiency
        link = "nvlink" if local == group else "nvlink+infiniband"
    return Collective(name, group, calls, per_rank, link, seconds + calls * gpu.collective_latency_s, overlapped)


def fsdp_collectives(inv: ModelInventory, layout: Layout, gpu: GpuSpec, *, param_bytes: int, reduce_bytes: int,
                     with_mtp: bool) -> dict[str, list[Collective]]:
    """Per unit: the forward all-gather, the backward all-gather (units resharded after forward), the reduce-scatter
    and (HSDP) the replica all-reduce of the FSDP-managed parameters. Keyed by unit name."""
    out: dict[str, list[Collective]] = {}
    span = layout.dp_shard * layout.cp * layout.tp
    for u in inv.units:
        if u.kind == "mtp" and not with_mtp:
            continue
        colls = []
        for expert in (False, True):
            part = Unit(u.name, u.kind, tuple(p for p in u.params if p.expert == expert), u.reshard_after_forward)
            gathered = unit_bytes(part, layout, dtype_bytes=param_bytes, sharded=False)
            grads = trainable_unit_bytes(part, layout, dtype_bytes=reduce_bytes)
            if expert and layout.ep > 1 and not layout.experts_sharded:
                continue  # whole experts: the out-of-FSDP all-reduce (other_collectives)
            if expert and layout.ep > 1:
                # expert_fsdp: gathered in forward and again in backward, reduce-scattered, inside the experts' op,
                # so on the critical path (FSDP2 prefetches its own gathers behind compute)
                group = layout.expert_shards
                colls += [_coll("expert all-gather", group, 2, gathered * 2, layout.gpus, gpu),
                          _coll("expert reduce-scatter", group, 1, grads, layout.gpus, gpu)]
                continue
            group = layout.fsdp
            gathers = 1 + int(u.reshard_after_forward)
            colls += [
                _coll("fsdp all-gather", group, gathers, gathered * gathers, span, gpu, overlapped=True),
                _coll("fsdp reduce-scatter", group, 1, grads, span, gpu, overlapped=True),
                _coll("hsdp all-reduce", layout.dp_replicate, 1, grads / group, layout.gpus, gpu, factor=2.0,
                      overlapped=True),
            ]
        out[u.name] = [c for c in colls if c is not None]
    return out


def other_collectives(inv: ModelInventory, layout: Layout, gpu: GpuSpec, ctx: ActContext, *, regime: str,
                      with_mtp: bool) -> list[Collective]:
    """Everything on the critical path: the out-of-FSDP gradients' all-reduces, EP all-to-all, TP, CP."""
    args, a = inv.args, ctx.act
    d = args.hidden_size
    out: list[Collective | None] = []
    experts = sum(outside_unit_bytes(Unit(u.name, u.kind, tuple(p for p in u.params if p.expert), True), layout,
                                     trainable_only=True) for u in inv.units)
    kept = state_bytes(inv, layout).replicated_grads - experts
    data_ranks = layout.gpus // layout.tp
    out.append(_coll("fp32-kept grad all-reduce", data_ranks, 1, kept, layout.gpus, gpu, factor=2.0))
    if layout.ep > 1 and not layout.experts_sharded:
        out.append(_coll("expert grad all-reduce", layout.dp_replicate * layout.edp, 1, experts, layout.gpus, gpu,
                         factor=2.0))
    layers = [u for u in inv.units if u.kind not in ("embed", "head") and (with_mtp or u.kind != "mtp")]
    n_moe = sum(1 for u in layers if u.kind.endswith("moe") or u.kind == "mtp")
    n_kda = sum(1 for u in layers if u.kind.startswith("kda"))
    n_dsa = sum(1 for u in layers if "dsa" in u.kind or u.kind == "mtp")
    tokens = ctx.tokens  # this rank's tokens (a TP group shares them)
    recompute = regime == "full"
    if layout.ep > 1:  # dispatch + combine forward, three in backward (+ the recomputed forward under full AC)
        calls = n_moe * (5 + 2 * int(recompute))
        rows = tokens * args.num_experts_per_tok * d * a
        out.append(_coll("ep all-to-all", layout.ep, calls, rows * calls, layout.ep * layout.tp, gpu, a2a=True))
    if layout.tp > 1:  # row-parallel outputs forward, column-parallel input gradients backward, the MLA latent
        calls = len(layers) * (4 + 2 * int(recompute)) + n_dsa
        nbytes = len(layers) * (4 + 2 * int(recompute)) * tokens * d * a + n_dsa * tokens * args.kv_lora_rank * a
        out.append(_coll("tp all-reduce", layout.tp, calls, nbytes, layout.tp, gpu, factor=2.0))
        if ctx.collect_stats:  # the KL target gathers every rank's absorbed queries
            heads = args.num_attention_heads * args.kv_lora_rank * a
            out.append(_coll("tp all-gather (KL queries)", layout.tp, n_dsa, n_dsa * tokens * heads, layout.tp, gpu))
    if layout.cp > 1:
        out += cp_collectives(inv, layout, gpu, ctx, regime=regime, n_kda=n_kda,
                              dsa=[u for u in layers if "dsa" in u.kind or u.kind == "mtp"])
    return [c for c in out if c is not None]


def cp_collectives(inv: ModelInventory, layout: Layout, gpu: GpuSpec, ctx: ActContext, *, regime: str, n_kda: int,
                   dsa: list[Unit]) -> list[Collective | None]:
    """Context parallelism as the model runs it (all on the critical path, over the cp ranks: span cp x tp):
    - KDA (ops/kda_cp.py, FLA's CP path on CUDA): per layer and row, the forward all-gathers every rank's exported
      states [2 zigzag parts, H, K, V + K] (FP32) and the backward the same for their gradients; both all-gather the
      rows' document ids first ([B, T_local] int64);
    - the three short convs' halos (conv_halo): an all-gather of each slot's last W-1 tokens [B, 2, W-1, H x K]
      forward, its reduce-scatter backward;
    - DSA (dsa.py) per layer: the MLA latent [B, T_local, kv_lora_rank] all-gathered forward, reduce-scattered
      backward; a layer with its own indexer also all-gathers its per-token keys and gate logits [B, T_local,
      index_head_dim] each (reduce-scattered backward when the indexer KL trains it).
    Recomputation: full AC re-runs every forward collective; selective AC saves the CP KDA op (kda_cp_fwd, with its
    state and document-id all-gathers) but re-runs the conv-halo and DSA all-gathers (not in its save list)."""
    args, a, cp, tp = inv.args, ctx.act, layout.cp, layout.tp
    span = cp * tp
    again = int(regime in ("full", "selective"))  # forward collectives recomputed in the backward
    rows, local = ctx.batch, ctx.tokens
    h, k = args.linear_num_heads // tp, args.linear_head_dim
    out: list[Collective | None] = []
    # all-gather over g ranks of a per-rank contribution x: the group's full tensor is g x x
    state = 2 * h * k * (k + k) * 4
    again_op = int(regime == "full")  # the CP KDA op itself: saved by selective AC
    calls = n_kda * rows * (2 + again_op)
    out.append(_coll("cp kda state all-gather", cp, calls, calls * cp * state, span, gpu))
    calls = n_kda * (2 + again_op)
    out.append(_coll("cp kda doc-id all-gather", cp, calls, calls * cp * local * 8, span, gpu))
    halo = rows * 2 * (args.linear_conv_kernel_dim - 1) * h * k * a
    calls = n_kda * 3 * (2 + again)
    out.append(_coll("cp kda conv halo all-gather/reduce-scatter", cp, calls, calls * cp * halo, span, gpu))
    calls = len(dsa) * (2 + again)
    out.append(_coll("cp dsa latent all-gather/reduce-scatter", cp, calls, calls * cp * local * args.kv_lora_rank * a,
                     span, gpu))
    n_idx = sum(1 for u in dsa if not u.shared_indexer)
    if args.dsa_attention == "sparse" or ctx.collect_stats:
        calls = n_idx * 2 * (1 + again + int(ctx.collect_stats))
        out.append(_coll("cp dsa indexer key/gate all-gather/reduce-scatter", cp, calls,
                         calls * cp * local * args.index_head_dim * a, span, gpu))
    return out
