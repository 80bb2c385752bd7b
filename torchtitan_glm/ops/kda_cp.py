"""KDA under context parallelism: each cp rank holds its zigzag (or contiguous) part of every row, computes the
local recurrence, and the states are chained across ranks so the result equals KDA over the whole row.

Layout (distributed/cp_layout.py): a row of T tokens is cut into S equal slots of c tokens (zigzag: S = 2*cp, rank
r holds slots r and 2*cp-1-r, in that order; contiguous: S = cp, rank r holds slot r). q, k, v, g, beta are this
rank's [B, S/cp * c, ...] part; `seq_idx` holds the (global) document id of each local token.

CPU: a torch implementation over gloo (FLA's CP kernels need an NVIDIA GPU). Per local slot it computes the
zero-start outputs and final state of each document run and, for a slot without an internal document boundary,
its state transition M (S_end = M S_start + S_end(0); ops.kda.kda_transition). The (final state, M) pairs are
all-gathered, chained in global slot order (a slot continues its predecessor when the document id carries over
the boundary), and each slot's first run is recomputed from its chained start state. The backward recomputes
this with autograd inside the custom op; the all-gather's gradient is an explicit all-reduce that every rank joins.
CUDA: FLA's own CP path, `chunk_kda_fwd/bwd(..., cp_context=build_cp_context(cu_seqlens, group, layout))` on each
row (FLA's CP takes one packed row), with the same affine-chain math.

The short convolutions before KDA need the conv_width-1 tokens preceding each slot: `conv_halo`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torchtitan_glm.distributed.collectives import all_gather_autograd

from .kda import (_FLA_CHUNK, _L2_EPS, _autograd_inside_kernel, _fla, _segments, kda_segment, kda_transition,
                  normalize_qk)

__all__ = ["kda_cp", "conv_halo", "CP_OP_LAYOUTS"]

CP_OP_LAYOUTS = ("zigzag", "contiguous")


def _group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _slots(layout: str, cp: int, rank: int) -> tuple[int, list[int]]:
    """(number of slots per row, global slots this rank holds in local order)."""
    if layout == "zigzag":
        return 2 * cp, [rank, 2 * cp - 1 - rank]
    if layout == "contiguous":
        return cp, [rank]
    raise ValueError(f"context-parallel KDA layout must be one of {CP_OP_LAYOUTS}, got {layout!r}")


def _global_doc_ids(seq_idx: Tensor | None, shape: tuple[int, int], layout: str, group: dist.ProcessGroup,
                    device: torch.device) -> Tensor:
    """[B, S, c] document ids of the whole row in global slot order (zeros: one document per row)."""
    cp = dist.get_world_size(group)
    b, t_local = shape
    num_slots, _ = _slots(layout, cp, 0)
    c = t_local * cp // num_slots
    if seq_idx is None:
        return torch.zeros(b, num_slots, c, dtype=torch.long, device=device)
    parts = [torch.empty_like(seq_idx, dtype=torch.long) for _ in range(cp)]
    dist.all_gather(parts, seq_idx.to(torch.long).contiguous(), group=group)
    out = torch.empty(b, num_slots, c, dtype=torch.long, device=device)
    for r, part in enumerate(parts):
        for j, slot in enumerate(_slots(layout, cp, r)[1]):
            out[:, slot] = part[:, j * c:(j + 1) * c]
    return out


# ---------------------------------------------------------------------------------------------
# CPU: torch implementation of the exchange
# ---------------------------------------------------------------------------------------------


class _CPRows:
    """The CPU CP computation split at its one exchange: local pass -> all-gather of the slot exports -> chain and
    finish. The backward runs the same pieces, with the exchange's gradient as an explicit all-reduce so every rank
    joins it whether or not its own output depends on other ranks' slots."""

    def __init__(self, q, k, v, g, beta, seq_idx, group: dist.ProcessGroup, layout: str) -> None:
        self.group, self.layout = group, layout
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        bsz, t_local, self.h, self.dk = q.shape
        self.dv = v.shape[-1]
        self.num_slots, self.mine = _slots(layout, self.cp, self.rank)
        self.c = t_local // len(self.mine)
        self.ids = _global_doc_ids(seq_idx, (bsz, t_local), layout, group, q.device)  # [B, S, c]
        self.through = (self.ids[..., 1:] == self.ids[..., :-1]).all(-1)  # [B, S]: no document boundary inside
        self.continues = torch.zeros_like(self.through)  # [B, S]: the slot continues its predecessor's document
        self.continues[:, 1:] = self.ids[:, 1:, 0] == self.ids[:, :-1, -1]

    def _slot(self, xs, b: int, j: int, run: tuple[int, int] | None = None):
        s, e = run if run is not None else (0, self.c)
        return [x[b:b + 1, j * self.c + s:j * self.c + e] for x in xs]

    def local_pass(self, xs) -> tuple[list[list[list[Tensor]]], Tensor]:
        """Zero-start outputs of every document run of every local slot, and the slot exports
        [B, slots mine, H, K, V + K] = (final state of the last run | transition M if the slot has no boundary)."""
        outs, exports = [], []
        for b in range(self.ids.shape[0]):
            row_out, row_exp = [], []
            for j, slot in enumerate(self.mine):
                pieces, final = [], None
                for run in _segments(self.ids[b, slot]):
                    o, final = kda_segment(*self._slot(xs, b, j, run))
                    pieces.append(o)
                q, k, v, g, beta = self._slot(xs, b, j)
                m = kda_transition(k, g, beta) if bool(self.through[b, slot]) else final.new_zeros(1, self.h, self.dk,
                                                                                                     self.dk)
                row_out.append(pieces)
                row_exp.append(torch.cat([final, m], -1))
            outs.append(row_out)
            exports.append(torch.cat(row_exp, 0))
        return outs, torch.stack(exports, 0)

    def gather(self, exports: Tensor) -> Tensor:
        parts = [torch.empty_like(exports) for _ in range(self.cp)]
        dist.all_gather(parts, exports.contiguous(), group=self.group)
        return torch.stack(parts, 0)  # [cp, B, slots mine, H, K, V + K]

    def finish(self, xs, outs, gathered: Tensor) -> Tensor:
        """Chain the gathered exports in global slot order; recompute each local slot's first run from its start."""
        by_slot = {}
        for r in range(self.cp):
            for j, slot in enumerate(_slots(self.layout, self.cp, r)[1]):
                by_slot[slot] = gathered[r, :, j]  # [B, H, K, V + K]
        rows = []
        for b in range(self.ids.shape[0]):
            start, end = [None] * self.num_slots, None
            for slot in range(self.num_slots):
                if slot > 0 and bool(self.continues[b, slot]):
                    start[slot] = end
                final, m = by_slot[slot][b].split([self.dv, self.dk], -1)
                end = final + m @ start[slot] if start[slot] is not None and bool(self.through[b, slot]) else final
            pieces_b = []
            for j, slot in enumerate(self.mine):
                pieces = list(outs[b][j])
                if start[slot] is not None:
                    run = _segments(self.ids[b, slot])[0]
                    pieces[0] = kda_segment(*self._slot(xs, b, j, run), start[slot].unsqueeze(0))[0]
                pieces_b.append(torch.cat(pieces, 1))
            rows.append(torch.cat(pieces_b, 1))
        return torch.cat(rows, 0)


def _prepared(q, k, v, g, beta) -> list[Tensor]:
    qf, kf = normalize_qk(q, k)
    return [qf, kf, v.float(), g.float(), beta.float()]


def _kda_cp_torch(q, k, v, g, beta, seq_idx, group: dist.ProcessGroup, layout: str) -> Tensor:
    rows = _CPRows(q, k, v, g, beta, seq_idx, group, layout)
    xs = _prepared(q, k, v, g, beta)
    outs, exports = rows.local_pass(xs)
    return rows.finish(xs, outs, rows.gather(exports)).to(v.dtype).contiguous()


def _torch_bwd(do, q, k, v, g, beta, seq_idx, group, layout) -> tuple[Tensor, ...]:
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    rows = _CPRows(q, k, v, g, beta, seq_idx, group, layout)
    with _autograd_inside_kernel():
        xs = _prepared(*inputs)
        outs, exports = rows.local_pass(xs)
        gathered = rows.gather(exports.detach()).requires_grad_(True)
        o = rows.finish(xs, outs, gathered)
        *grads, d_gathered = torch.autograd.grad(o, [*inputs, gathered], do.to(o.dtype), retain_graph=True,
                                                 allow_unused=True)
        d_gathered = torch.zeros_like(gathered) if d_gathered is None else d_gathered.contiguous()
        dist.all_reduce(d_gathered, group=group)  # every rank's use of every slot's export, summed
        more = torch.autograd.grad(exports, inputs, d_gathered[rows.rank], allow_unused=True)
    return tuple((torch.zeros_like(x) if a is None else a) + (0 if b is None else b)
                 for x, a, b in zip(inputs, grads, more))


# ---------------------------------------------------------------------------------------------
# CUDA: FLA's CP path, one row at a time
# ---------------------------------------------------------------------------------------------


def _fla_cp_context(ids_row: Tensor, group: dist.ProcessGroup, layout: str, device: torch.device):
    """FLA's rank-local context for one row, from the row's global document ids [S, c] (slot order = row order)."""
    from fla.ops.cp import build_cp_context

    flat = ids_row.reshape(-1).cpu()
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1]
    cu_cpu = torch.cat([torch.nonzero(start).flatten(), torch.tensor([flat.numel()])])
    return build_cp_context(cu_cpu.to(device), group, cu_seqlens_cpu=cu_cpu, layout=layout)


def _fla_cp_fwd(q, k, v, g, beta, seq_idx, group, layout, safe_gate):
    fla = _fla()
    bsz, t, h, dk = q.shape
    ids = _global_doc_ids(seq_idx, (bsz, t), layout, group, q.device)
    outs, a_qks, a_kks, h0s = [], [], [], []
    for b in range(bsz):
        ctx = _fla_cp_context(ids[b], group, layout, q.device)
        chunk_indices = fla.prepare_chunk_indices(ctx.cu_seqlens, _FLA_CHUNK, cu_seqlens_cpu=ctx.cu_seqlens_cpu)
        row = [x[b:b + 1].contiguous() for x in (q, k, v, g, beta)]
        qn, _ = fla.l2norm_fwd(row[0], eps=_L2_EPS)
        kn, _ = fla.l2norm_fwd(row[1], eps=_L2_EPS)
        o, _, _, a_qk, a_kk, *_, h0 = fla.chunk_kda_fwd(
            q=qn, k=kn, v=row[2], g=row[3], beta=row[4], scale=dk**-0.5, initial_state=None,
            output_final_state=False, cu_seqlens=ctx.cu_seqlens, cu_seqlens_cpu=ctx.cu_seqlens_cpu,
            chunk_indices=chunk_indices, chunk_size=_FLA_CHUNK, safe_gate=safe_gate, cp_context=ctx,
        )
        outs.append(o.to(v.dtype))
        a_qks.append(a_qk)
        a_kks.append(a_kk)
        h0s.append(_fixed_h0(h0, ctx, h, dk, v.shape[-1], q.device))
    return torch.cat(outs, 0), [torch.cat(a_qks, 0), torch.cat(a_kks, 0), torch.stack(h0s, 0)]


def _fixed_h0(h0, ctx, h, dk, dv, device) -> Tensor:
    """FLA's compressed cross-rank start states at a data-independent shape [slots mine, H, K, V] (fp32)."""
    n = 2 if ctx.layout == "zigzag" else 1
    if h0 is None:
        return torch.zeros(n, h, dk, dv, dtype=torch.float32, device=device)
    if ctx.layout == "zigzag" and len(ctx.cu_seqlens) - 1 > 2 and h0.shape[0] != 2:
        h0 = h0[[0, ctx.front_num_seqs]]
    return h0[:n].float()


def _fla_cp_bwd(do, q, k, v, g, beta, seq_idx, residuals, group, layout, safe_gate):
    fla = _fla()
    from fla.ops.cp.chunk_delta_h import compress_h0

    bsz, t, h, dk = q.shape
    ids = _global_doc_ids(seq_idx, (bsz, t), layout, group, q.device)
    a_qk_all, a_kk_all, h0_all = residuals
    grads = [[] for _ in range(5)]
    for b in range(bsz):
        ctx = _fla_cp_context(ids[b], group, layout, q.device)
        chunk_indices = fla.prepare_chunk_indices(ctx.cu_seqlens, _FLA_CHUNK, cu_seqlens_cpu=ctx.cu_seqlens_cpu)
        row = [x[b:b + 1].contiguous() for x in (do, q, k, v, g, beta)]
        qn, q_rstd = fla.l2norm_fwd(row[1], eps=_L2_EPS)
        kn, k_rstd = fla.l2norm_fwd(row[2], eps=_L2_EPS)
        g_cum = fla.chunk_local_cumsum(row[4], chunk_size=_FLA_CHUNK, scale=fla.RCP_LN2, cu_seqlens=ctx.cu_seqlens,
                                       chunk_indices=chunk_indices)
        n_seqs = len(ctx.cu_seqlens) - 1
        full = h0_all.new_zeros(n_seqs, *h0_all.shape[2:])
        if layout == "zigzag":
            full[[0, ctx.front_num_seqs]] = h0_all[b]
        else:
            full[:1] = h0_all[b]
        dq, dk_, dv, db, dg, *_ = fla.chunk_kda_bwd(
            q=qn, k=kn, v=row[3], beta=row[5], Aqk=a_qk_all[b:b + 1], Akk=a_kk_all[b:b + 1], scale=dk**-0.5,
            initial_state=compress_h0(full, ctx), do=row[0], dht=None, g=g_cum, cu_seqlens=ctx.cu_seqlens,
            chunk_indices=chunk_indices, chunk_size=_FLA_CHUNK, safe_gate=safe_gate, cp_context=ctx,
        )
        dq = fla.l2norm_bwd(qn, q_rstd, dq, eps=_L2_EPS)
        dk_ = fla.l2norm_bwd(kn, k_rstd, dk_, eps=_L2_EPS)
        for acc, d in zip(grads, (dq, dk_, dv, dg, db)):
            acc.append(d)
    return tuple(torch.cat(d, 0).to(x.dtype) for d, x in zip(grads, (q, k, v, g, beta)))


# ---------------------------------------------------------------------------------------------
# Custom ops (opaque to compile; the collectives run inside them)
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("torchtitan_glm::kda_cp_fwd", mutates_args=(), device_types="cpu")
def kda_cp_fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seq_idx: Tensor | None, group_name: str, layout: str,
    safe_gate: bool,
) -> tuple[Tensor, list[Tensor]]:
    """KDA forward over the cp group `group_name`: (o, residuals for kda_cp_bwd). CPU: torch, no residuals."""
    with torch.autocast("cpu", enabled=False), torch.no_grad():
        return _kda_cp_torch(q, k, v, g, beta, seq_idx, _group(group_name), layout), []


@kda_cp_fwd.register_kernel("cuda")
def _kda_cp_fwd_cuda(q, k, v, g, beta, seq_idx, group_name, layout, safe_gate):
    with torch.cuda.device(q.device), torch.autocast("cuda", enabled=False):
        return _fla_cp_fwd(q, k, v, g, beta, seq_idx, _group(group_name), layout, safe_gate)


@kda_cp_fwd.register_fake
def _kda_cp_fwd_fake(q, k, v, g, beta, seq_idx, group_name, layout, safe_gate):
    o = torch.empty_like(v, memory_format=torch.contiguous_format)
    if q.device.type != "cuda":
        return o, []
    b, t, h, dk = q.shape
    n = 2 if layout == "zigzag" else 1
    return o, [k.new_empty(b, t, h, _FLA_CHUNK), k.new_empty(b, t, h, _FLA_CHUNK),
               q.new_empty(b, n, h, dk, v.shape[-1], dtype=torch.float32)]


@torch.library.custom_op("torchtitan_glm::kda_cp_bwd", mutates_args=(), device_types="cpu")
def kda_cp_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seq_idx: Tensor | None,
    residuals: list[Tensor], group_name: str, layout: str, safe_gate: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """KDA-CP backward: (dq, dk, dv, dg, dbeta). CPU: recompute the torch CP forward and differentiate it (the
    all-gather's backward sends each slot's state gradient back to its rank)."""
    with torch.autocast("cpu", enabled=False):
        return _torch_bwd(do, q, k, v, g, beta, seq_idx, _group(group_name), layout)


@kda_cp_bwd.register_kernel("cuda")
def _kda_cp_bwd_cuda(do, q, k, v, g, beta, seq_idx, residuals, group_name, layout, safe_gate):
    with torch.cuda.device(q.device), torch.autocast("cuda", enabled=False):
        return _fla_cp_bwd(do, q, k, v, g, beta, seq_idx, residuals, _group(group_name), layout, safe_gate)


@kda_cp_bwd.register_fake
def _kda_cp_bwd_fake(do, q, k, v, g, beta, seq_idx, residuals, group_name, layout, safe_gate):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, seq_idx, group_name, layout, safe_gate = inputs
    _, residuals = output
    ctx.mark_non_differentiable(*residuals)
    ctx.save_for_backward(q, k, v, g, beta, seq_idx, *residuals)
    ctx.group_name, ctx.layout, ctx.safe_gate = group_name, layout, safe_gate


def _backward(ctx, do, _dresiduals):
    q, k, v, g, beta, seq_idx, *residuals = ctx.saved_tensors
    grads = torch.ops.torchtitan_glm.kda_cp_bwd(do, q, k, v, g, beta, seq_idx, residuals, ctx.group_name,
                                                ctx.layout, ctx.safe_gate)
    return (*grads, None, None, None, None)


torch.library.register_autograd("torchtitan_glm::kda_cp_fwd", _backward, setup_context=_setup_context)


def kda_cp(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seq_idx: Tensor | None = None, *,
    group: dist.ProcessGroup, layout: str = "zigzag", safe_gate: bool,
) -> Tensor:
    """KDA over rows split across the cp `group` (same contract as ops.kda.kda on this rank's part; seq_idx =
    the global document ids of the local tokens, as cp_layout shards them). Equals KDA on the whole rows."""
    cp = dist.get_world_size(group)
    num_slots, mine = _slots(layout, cp, dist.get_rank(group))
    if q.shape[1] % len(mine):
        raise ValueError(f"the local length {q.shape[1]} does not split into {len(mine)} equal {layout} slots")
    o, _ = torch.ops.torchtitan_glm.kda_cp_fwd(q, k, v, g, beta, seq_idx, group.group_name, layout, safe_gate)
    return o


def conv_halo(x: Tensor, width: int, *, group: dist.ProcessGroup, layout: str = "zigzag") -> Tensor:
    """The width-1 tokens that precede each of this rank's slots in the whole row: x [B, T_local, C] -> halo
    [B, slots mine, width-1, C] (zeros before the row start). Differentiable (an all-gather of every slot's tail);
    the short conv masks the taps that reach into another document by the global position in document."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    num_slots, mine = _slots(layout, cp, rank)
    bsz, t_local, ch = x.shape
    c = t_local // len(mine)
    w = width - 1
    if c < w:
        raise ValueError(f"context-parallel slots of {c} tokens are shorter than the conv halo ({w} tokens)")
    tails = x.view(bsz, len(mine), c, ch)[:, :, c - w:]  # [B, slots mine, w, C]
    gathered = all_gather_autograd(tails.unsqueeze(0), dim=0, group=group)  # [cp, B, slots mine, w, C]
    owner = {slot: r * len(mine) + j for r in range(cp) for j, slot in enumerate(_slots(layout, cp, r)[1])}
    flat = gathered.transpose(1, 2).reshape(cp * len(mine), bsz, w, ch)  # [(rank, local slot), B, w, C]
    # entry 0 is zeros and entry s + 1 the tail of slot s, so slot s's halo is entry s. Indexing one tensor (not
    # building slot 0's zeros apart) keeps every rank's output on the all-gather, whose backward is a collective
    # that all ranks must join.
    by_slot = torch.cat([x.new_zeros(1, bsz, w, ch), flat[[owner[s] for s in range(num_slots)]]], 0)
    return by_slot[list(mine)].transpose(0, 1)
