"""Expert parallelism: routed experts sharded over the ep group, tokens dispatched to the rank holding their expert
and combined back with all-to-alls, a grouped GEMM over the local experts in between.

Why a custom op: the per-rank token counts (and so the all-to-all splits and the received row count) depend on the
routing. Inside an opaque torch.library op the exchange runs eagerly with host-side splits while the compiled block
around it sees static shapes (input and output are the [N*k, D] expert-sorted rows, as without EP), so no unbacked
sizes reach the graph and new routings never recompile. The backward recomputes the dispatch (one more all-to-all
of the rows, as activation checkpointing would) and differentiates the local experts' math with autograd.

Layout: x [N, D] holds this rank's routed rows sorted by global expert id (counts [E]); rank r of the group owns
experts [r*E/ep, (r+1)*E/ep) (the Shard(0) of the stacked weights). The experts run in x's dtype (their weights
are cast as FSDP2's mixed precision would); weight gradients come back in the weights' dtype.

Expert sharding (`shard_group`, parallelism.expert_fsdp): the ranks that hold the same experts (the expert-data
group) each keep 1/edp of every local expert's rows (dim 1 of the [E/ep, out, in] weights), as FSDP2 keeps its
shards. The op all-gathers the full local experts in x's dtype (forward, and again in backward, as FSDP2's
reshard-after-forward does), and reduce-scatters the weight gradients in the weights' dtype, scaled by
`grad_scale`; the gathers are started before the token exchange and the reduce-scatters before the combine, so on
their own communicator they can overlap it. Inside the op, not as FSDP2 hooks on the experts: hooks inside a block
would break its compiled graph.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from torchtitan_glm.ops.kda import _autograd_inside_kernel

__all__ = ["expert_parallel_swiglu"]


def _group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


class _Plan:
    """Splits and the rank-major -> expert-major permutation of one dispatch (host-side lists: eager only)."""

    def __init__(self, counts: Tensor, group: dist.ProcessGroup, num_local: int) -> None:
        ep = dist.get_world_size(group)
        self.group = group
        send = counts.to(torch.long).view(ep, num_local).contiguous()  # [dest rank, its local expert]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)  # [source rank, my local expert]
        self.input_splits = send.sum(1).tolist()
        self.output_splits = recv.sum(1).tolist()
        self.local_counts = recv.sum(0)  # [num_local] rows per local expert
        # received rows are (source rank, expert)-major; the grouped GEMM wants expert-major
        lens = recv.flatten()
        starts = lens.cumsum(0) - lens
        seg = torch.arange(lens.numel(), device=counts.device).view(ep, num_local).t().flatten()
        self.perm = torch.cat([torch.arange(int(starts[s]), int(starts[s] + lens[s]), device=counts.device)
                               for s in seg.tolist()]) if lens.sum() > 0 else lens.new_zeros(0)

    def dispatch(self, x: Tensor) -> Tensor:
        out = x.new_empty(sum(self.output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), self.output_splits, self.input_splits, group=self.group)
        return out[self.perm]

    def combine(self, y: Tensor) -> Tensor:
        back = torch.empty_like(y)
        back[self.perm] = y
        out = y.new_empty(sum(self.input_splits), *y.shape[1:])
        dist.all_to_all_single(out, back.contiguous(), self.input_splits, self.output_splits, group=self.group)
        return out


def _gather_rows(w: Tensor, group: dist.ProcessGroup) -> Callable[[], Tensor]:
    """Start gathering the group's n ranks' [E, out/n, in] shards; the returned call waits and gives the full
    [E, out, in] (rank-major along dim 1)."""
    n = dist.get_world_size(group)
    out = w.new_empty(n * w.shape[0], *w.shape[1:])  # rank-major along dim 0, as the collective writes it
    work = dist.all_gather_into_tensor(out, w.contiguous(), group=group, async_op=True)

    def wait() -> Tensor:
        work.wait()
        return out.view(n, *w.shape).movedim(0, 1).reshape(w.shape[0], n * w.shape[1], *w.shape[2:])
    return wait


def _reduce_scatter_rows(g: Tensor, group: dist.ProcessGroup) -> Callable[[], Tensor]:
    """Start summing [E, out, in] over the group's ranks, each keeping its [E, out/n, in] rows (the inverse of
    _gather_rows); the returned call waits and gives them."""
    n = dist.get_world_size(group)
    parts = g.reshape(g.shape[0], n, g.shape[1] // n, *g.shape[2:]).movedim(1, 0).contiguous()
    out = g.new_empty(parts.shape[1:])
    work = dist.reduce_scatter_tensor(out, parts.flatten(0, 1), group=group, async_op=True)

    def wait() -> Tensor:
        work.wait()
        return out
    return wait


def _full_weights(ws: tuple[Tensor, ...], dtype: torch.dtype, shard_group_name: str) -> Callable[[], list[Tensor]]:
    """The local experts' weights in the compute dtype, gathered over the expert-data group when they are sharded.
    Started at once, waited for by the returned call: the gathers (on their own group) overlap the token exchange."""
    ws = [w.to(dtype) for w in ws]
    if not shard_group_name:
        return lambda: ws
    group = _group(shard_group_name)
    pending = [_gather_rows(w, group) for w in ws]
    return lambda: [wait() for wait in pending]


def _local(x, counts, w_gate, w_up, w_down, swiglu_limit, fp8):
    from torchtitan_glm.models.glm5.moe import grouped_swiglu

    ws = [w.to(x.dtype) for w in (w_gate, w_up, w_down)]
    return grouped_swiglu(x, counts, *ws, swiglu_limit=swiglu_limit, fp8=fp8)


@torch.library.custom_op("torchtitan_glm::ep_swiglu_fwd", mutates_args=())
def ep_swiglu_fwd(x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, group_name: str,
                  swiglu_limit: float, fp8: bool, shard_group_name: str, grad_scale: float) -> Tensor:
    """Dispatch -> local experts -> combine; [N, D] -> [N, D] in x's row order."""
    with torch.no_grad():
        full = _full_weights((w_gate, w_up, w_down), x.dtype, shard_group_name)
        plan = _Plan(counts, _group(group_name), w_gate.shape[0])
        xs = plan.dispatch(x)
        y = _local(xs, plan.local_counts, *full(), swiglu_limit, fp8)
    return plan.combine(y)


@ep_swiglu_fwd.register_fake
def _(x, counts, w_gate, w_up, w_down, group_name, swiglu_limit, fp8, shard_group_name, grad_scale):
    return torch.empty_like(x)


@torch.library.custom_op("torchtitan_glm::ep_swiglu_bwd", mutates_args=())
def ep_swiglu_bwd(dy: Tensor, x: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                  group_name: str, swiglu_limit: float, fp8: bool, shard_group_name: str,
                  grad_scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dw_gate, dw_up, dw_down): dispatch x and dy again, differentiate the local experts, combine dx; with
    sharded experts the weight gradients are reduce-scattered over the expert-data group and scaled."""
    shards = (w_gate, w_up, w_down)
    if shard_group_name:
        with torch.no_grad():
            full = _full_weights(shards, x.dtype, shard_group_name)
    plan = _Plan(counts, _group(group_name), w_gate.shape[0])
    xs = plan.dispatch(x).detach().requires_grad_(True)
    dys = plan.dispatch(dy)
    if shard_group_name:
        ws = [w.requires_grad_(True) for w in full()]
    else:
        ws = [w.detach().requires_grad_(True) for w in shards]
    with _autograd_inside_kernel():
        y = _local(xs, plan.local_counts, *ws, swiglu_limit, fp8)
        grads = torch.autograd.grad(y, [xs, *ws], dys.to(y.dtype), allow_unused=True)
    dxs, *dws = (torch.zeros_like(t) if g is None else g for t, g in zip([xs, *ws], grads))
    if shard_group_name:  # the reduce-scatters overlap the combine's all-to-all
        group = _group(shard_group_name)
        pending = [_reduce_scatter_rows(g.to(w.dtype), group) for g, w in zip(dws, shards)]
        dx = plan.combine(dxs.to(x.dtype))
        return (dx, *(wait().mul_(grad_scale) for wait in pending))
    return (plan.combine(dxs.to(x.dtype)), *(g.contiguous() for g in dws))


@ep_swiglu_bwd.register_fake
def _(dy, x, counts, w_gate, w_up, w_down, group_name, swiglu_limit, fp8, shard_group_name, grad_scale):
    return torch.empty_like(x), torch.empty_like(w_gate), torch.empty_like(w_up), torch.empty_like(w_down)


def _setup_context(ctx, inputs, output) -> None:
    x, counts, w_gate, w_up, w_down, *args = inputs
    ctx.save_for_backward(x, counts, w_gate, w_up, w_down)
    ctx.args = tuple(args)


def _backward(ctx, dy):
    x, counts, w_gate, w_up, w_down = ctx.saved_tensors
    dx, dg, du, dd = torch.ops.torchtitan_glm.ep_swiglu_bwd(dy.contiguous(), x, counts, w_gate, w_up, w_down,
                                                            *ctx.args)
    return dx, None, dg, du, dd, None, None, None, None, None


ep_swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


def expert_parallel_swiglu(x_sorted: Tensor, counts: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, *,
                           group: dist.ProcessGroup, swiglu_limit: float, fp8: bool,
                           shard_group: dist.ProcessGroup | None = None, grad_scale: float = 1.0) -> Tensor:
    """The routed experts of one MoE layer under expert parallelism (see module docstring): x_sorted [N, D] rows
    sorted by global expert, counts [E], this rank's expert weights [E/ep, out, in] -> [N, D]; with `shard_group`
    the weights are this rank's [E/ep, out/edp, in] rows of them (gradients reduce-scattered, times grad_scale)."""
    return ep_swiglu_fwd(x_sorted, counts, w_gate, w_up, w_down, group.group_name, swiglu_limit, fp8,
                         "" if shard_group is None else shard_group.group_name, grad_scale)
