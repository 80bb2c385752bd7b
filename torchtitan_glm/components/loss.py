"""Training losses beyond the LM head's fused CE: the DSA indexer KL loss and MoE balancing.

Cross-entropy itself (chunked, FP32, token-weighted) runs inside the model's LM head (ops/linear_cross_entropy.py)
so FSDP sees one head call per step; here are the token weights that make it a global token mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan_glm.models.glm5.dsa import IndexerStats
from torchtitan_glm.models.glm5.moe import MoEStats, Router


def global_token_counts(*labels: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Non-ignored labels of each tensor summed over the data-parallel group: one all-reduce, a float [n] tensor."""
    counts = torch.stack([(t != -100).sum() for t in labels]).to(torch.float32)
    if dist.is_initialized():
        dist.all_reduce(counts, group=group)
    return counts


def token_scale(global_count: torch.Tensor, *, dp_size: int) -> torch.Tensor:
    """Per-token loss weight: FSDP averages gradients over dp ranks, so dp/N_global gives the global token mean."""
    return dp_size / global_count.clamp_min(1.0)


def indexer_kl_loss(stats: list[IndexerStats], *, sparse: bool) -> torch.Tensor:
    """sum over DSA layers of mean_t KL(p_t || softmax(I_t)) over the pools visible to query t.

    p_t is the main attention's head-summed probability mass per pool (already L1-normalised, no grad); with
    `sparse` both distributions are restricted to the pools the sparse attention selected (DeepSeek-V3.2's
    sparse stage). Queries without any candidate pool do not count.
    """
    total = None
    for s in stats:
        support = s.valid & s.selected if sparse else s.valid
        target = s.target * support
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-20)
        logq = torch.log_softmax(s.logits.float().masked_fill(~support, float("-inf")), dim=-1)
        # `target != 0` rather than `> 0`: a NaN target (NaN attention upstream) must make the KL NaN, not 0.
        terms = torch.where(target != 0, target * (torch.log(target.clamp_min(1e-30)) - logq), torch.zeros_like(target))
        rows = support.any(-1)
        kl = terms.sum(-1)[rows].sum() / rows.sum().clamp_min(1)
        total = kl if total is None else total + kl
    if total is None:
        raise ValueError("indexer_kl_loss needs indexer stats: run the model with collect_indexer_stats=True")
    return total


def sequence_aux_loss(stats: list[MoEStats]) -> torch.Tensor:
    """Mean over MoE layers of the sequence-level balance loss the layers computed."""
    return torch.stack([s.aux_loss for s in stats]).mean()


def routers(model: torch.nn.Module) -> list[Router]:
    """Routers in the order the model returns MoE stats (trunk layers, then MTP)."""
    return [m for m in model.modules() if isinstance(m, Router)]


@torch.no_grad()
def update_router_bias(
    model: torch.nn.Module, counts: list[torch.Tensor], *, rate: float, group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Aux-loss-free balancing: bias_e += rate * sign(mean load - load_e), loads summed over the dp group.

    Returns the max/mean load ratio per router (for the imbalance metric).
    """
    rs = routers(model)
    if len(rs) != len(counts):
        raise ValueError(f"{len(counts)} MoE count tensors for {len(rs)} routers")
    if not rs:
        return torch.zeros(0)
    loads = torch.stack([c.to(torch.float32) for c in counts])
    if dist.is_initialized():
        dist.all_reduce(loads, group=group)
    mean = loads.mean(-1, keepdim=True)
    for router, load, m in zip(rs, loads, mean):
        router.e_score_correction_bias.add_(rate * torch.sign(m - load).to(router.e_score_correction_bias.device))
    return loads.max(-1).values / mean.squeeze(-1).clamp_min(1e-9)
