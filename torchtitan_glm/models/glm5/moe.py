"""MoE: FP32 sigmoid router with a bias-corrected, group-limited top-k; stacked experts run as grouped GEMMs."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchtitan_glm.ops.grouped_mm import FP8_GROUP_ALIGN, grouped_mm, pad_groups

from .args import Glm5ModelArgs
from .layers import DenseMLP, local_param, swiglu


class MoEStats(NamedTuple):
    """Per-layer routing statistics returned to the trainer."""

    counts: torch.Tensor  # [E] tokens routed to each expert (int64), for bias balancing and imbalance metrics
    aux_loss: torch.Tensor  # scalar sequence-level balance loss (0 unless requested)


class Router(nn.Module):
    """sigmoid(x W^T) in FP32; choice scores add `e_score_correction_bias` (a buffer the trainer updates)."""

    keep_fp32 = True

    def __init__(self, args: Glm5ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.n_routed_experts, args.num_experts_per_tok
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.scaling = args.routed_scaling_factor
        self.init_std = args.initializer_range
        self.weight = nn.Parameter(torch.empty(self.num_experts, args.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (scores [N, E] FP32, top-k expert ids [N, k], top-k weights [N, k] FP32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.unflatten(-1, (self.n_group, -1))
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
                -1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, idx, weights * self.scaling

    def init_weights(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        nn.init.zeros_(self.e_score_correction_bias)


def grouped_swiglu(x_sorted: torch.Tensor, counts: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                   down_proj: torch.Tensor, *, swiglu_limit: float, fp8: bool) -> torch.Tensor:
    """The experts' math: rows of x_sorted grouped by expert (counts [G]) through G stacked SwiGLU experts
    ([G, out, in] weights). With fp8 every group is padded to FP8_GROUP_ALIGN rows for the FP8 grouped GEMM."""
    if fp8:
        x_sorted, offs, index = pad_groups(x_sorted, counts, align=FP8_GROUP_ALIGN)
    else:
        offs = counts.cumsum(0).to(torch.int32)
    gate = grouped_mm(x_sorted, gate_proj.transpose(-2, -1), offs, fp8=fp8)
    up = grouped_mm(x_sorted, up_proj.transpose(-2, -1), offs, fp8=fp8)
    out = grouped_mm(swiglu(gate, up, swiglu_limit), down_proj.transpose(-2, -1), offs, fp8=fp8)
    return out[index] if fp8 else out


def _by_token(rows: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """Expert-sorted rows [N*k, D] back in (token, slot) order, [N, k, D]: row i goes to order[i], a permutation, so
    no two writes meet (no atomics; the backward is a gather)."""
    return torch.empty_like(rows).index_copy(0, order, rows).view(order.numel() // k, k, -1)


class _Dispatch(torch.autograd.Function):
    """flat[order // k]: each token's row once per slot, in expert order. The backward sums each token's k row
    gradients in (token, slot) order, in FP32 with one rounding; the gather's own backward would add them with an
    accumulating scatter (atomics on the GPU, a BF16 rounding per add, the order changing run to run)."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.k = k
        return flat[order // k]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        return _by_token(grad, order, ctx.k).sum(1), None, None


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked [E, out, in] weights (HF splits them per expert on export).

    `fp8` (set by float8.py's conversion, never by hand) runs the three grouped GEMMs in FP8 rowwise, with every
    expert's token group padded to a multiple of 16 rows as the FP8 grouped GEMM requires. `ep_group` (set by
    parallelize.py's expert parallelism) holds this rank's E/ep experts and exchanges the tokens with the other ranks
    of that group (ops/expert_parallel.py); `shard_group` (parallelism.expert_fsdp) shards their rows further over the
    ranks that hold the same experts."""

    linear_roles = {"gate_proj": "experts", "up_proj": "experts", "down_proj": "experts"}

    def __init__(self, args: Glm5ModelArgs) -> None:
        super().__init__()
        e, d, i = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
        self.swiglu_limit = args.swiglu_limit
        self.init_std = args.initializer_range
        self.fp8 = False
        self.ep_group = None
        self.shard_group = None  # parallelize.py: the expert-data group the weights' rows are sharded over
        self.grad_scale = 1.0  # ... and the factor its reduce-scattered gradients take
        self.gate_proj = nn.Parameter(torch.empty(e, i, d))
        self.up_proj = nn.Parameter(torch.empty(e, i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))

    def forward(self, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of x_sorted grouped by expert (counts [E] rows per expert) -> expert outputs, same order."""
        weights = [local_param(w) for w in (self.gate_proj, self.up_proj, self.down_proj)]
        if self.ep_group is not None:
            from torchtitan_glm.ops.expert_parallel import expert_parallel_swiglu

            return expert_parallel_swiglu(x_sorted, counts, *weights, group=self.ep_group,
                                          swiglu_limit=self.swiglu_limit, fp8=self.fp8,
                                          shard_group=self.shard_group, grad_scale=self.grad_scale)
        return grouped_swiglu(x_sorted, counts, *weights, swiglu_limit=self.swiglu_limit, fp8=self.fp8)

    def init_weights(self) -> None:
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(w, mean=0.0, std=self.init_std)


class MoE(nn.Module):
    """Routed experts (top-k, weighted) plus one always-on shared expert.

    `chunk_tokens` (set by activation_checkpoint.py from activation_checkpoint.moe_chunk_tokens, never by hand): when
    positive and smaller than the tokens, the routed experts (permutation, grouped GEMMs, combine) run over token
    chunks of that many tokens, each checkpointed: backward holds one chunk's expert activations at a time and
    recomputes them, for long sequences (at T = 64K the proxy's expert activations were ~25 GiB of one layer). The
    router runs over all tokens first, so routing, its statistics and the balance loss are those of the whole
    sequence, and every token's output is the unchunked one."""

    def __init__(self, args: Glm5ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.n_routed_experts, args.num_experts_per_tok
        self.gate = Router(args)
        self.experts = GroupedExperts(args)
        self.shared_experts = DenseMLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts,
                                       swiglu_limit=args.swiglu_limit, role="shared_expert")
        self.init_std = args.initializer_range
        self.chunk_tokens = 0

    def forward(self, x: torch.Tensor, *, seq_aux: bool = False) -> tuple[torch.Tensor, MoEStats]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scores, idx, weights = self.gate(flat)
        n, chunk = flat.shape[0], self.chunk_tokens
        if 0 < chunk < n:
            parts = [checkpoint(self._routed, flat[s:s + chunk], idx[s:s + chunk], weights[s:s + chunk],
                                use_reentrant=False, preserve_rng_state=False) for s in range(0, n, chunk)]
            out = torch.cat([o for o, _ in parts])
            counts = torch.stack([c for _, c in parts]).sum(0)
        else:
            out, counts = self._routed(flat, idx, weights)
        out = out.view(shape) + self.shared_experts(x)
        aux = sequence_aux_loss(scores, idx, batch=shape[0], top_k=self.top_k) if seq_aux else scores.new_zeros(())
        return out, MoEStats(counts, aux)

    def _routed(self, flat: torch.Tensor, idx: torch.Tensor,
                weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [N, D] through their top-k experts (ids, weights [N, k]) -> (weighted sum [N, D], rows per expert).

        The combine puts the expert rows back in (token, slot) order and sums each token's k weighted rows: `order`
        is a permutation, so that is a scatter without collisions (its backward a gather), and the sum accumulates
        in FP32 with one rounding, in a fixed order. An index_add over the expert-sorted rows would add each
        token's k rows with atomics on the GPU, rounding to BF16 at each add in an order that changes run to run.
        The dispatch's backward (_Dispatch) sums each token's k row gradients the same way."""
        n, k = idx.shape
        experts = idx.flatten()
        order = torch.argsort(experts, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).scatter_add_(
            0, experts, torch.ones_like(experts))  # static shape (bincount is data-dependent under compile)
        routed = self.experts(_Dispatch.apply(flat, order, k), counts)
        return (_by_token(routed, order, k) * weights.unsqueeze(-1).to(routed.dtype)).sum(1).to(flat.dtype), counts

    def init_weights(self) -> None:
        self.gate.init_weights()
        self.experts.init_weights()
        self.shared_experts.init_weights(std=self.init_std)


def sequence_aux_loss(scores: torch.Tensor, idx: torch.Tensor, *, batch: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss sum_e f_e * P_e per row, averaged over rows (coefficient applied by
    the trainer): f_e = E/(k T) * tokens routed to e, P_e = mean over tokens of normalised affinity s_e / sum s."""
    num_experts = scores.shape[-1]
    s = scores.view(batch, -1, num_experts)
    seqlen = s.shape[1]
    hits = torch.zeros_like(s).scatter(-1, idx.view(batch, seqlen, top_k), 1.0)
    f = hits.sum(1) * num_experts / (top_k * seqlen)
    p = (s / s.sum(-1, keepdim=True)).mean(1)
    return (f * p).sum(-1).mean()
