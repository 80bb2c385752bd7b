"""Training losses beyond the LM head's fused CE: the DSA indexer KL loss and MoE balancing.

Cross-entropy itself (chunked, FP32, token-weighted) runs inside the model's LM head (ops/linear_cross_entropy.py)
so FSDP sees one head call per step; here are the token weights that make it a global token mean.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from torchtitan_glm.models.glm5.dsa import IndexerStats
from torchtitan_glm.models.glm5.moe import MoEStats, Router


def global_token_counts(*labels: torch.Tensor | Sequence[torch.Tensor],
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Non-ignored labels of each argument summed over the data-parallel group: one all-reduce, a float [n] tensor.
    An argument is a label tensor, or a step's microbatches as a list of them (summed)."""
    counts = torch.stack([sum((t != -100).sum() for t in ([x] if isinstance(x, torch.Tensor) else x))
                          for x in labels]).to(torch.float32)
    if dist.is_initialized():
        dist.all_reduce(counts, group=group)
    return counts


def token_scale(global_count: torch.Tensor, *, dp_size: int) -> torch.Tensor:
    """Per-token loss weight: FSDP averages gradients over dp ranks, so dp/N_global gives the global token mean."""
    return dp_size / global_count.clamp_min(1.0)


def indexer_kl_loss(stats: list[IndexerStats], *, dp_size: int = 1,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """sum over DSA layers of mean_t KL(p_t || softmax(I_t)), each layer's KL computed inside it (models/glm5/dsa.py,
    ops/indexer_kl.py): over the selected pools with loss.indexer_sparse_loss (DeepSeek-V3.2's sparse stage), else over
    every pool visible to query t. Queries without any candidate pool do not count.

    With a data-parallel `group` the mean is over the counted queries of the whole global batch (one all-reduce of
    the per-layer counts), scaled by dp_size as the CE is, so that FSDP's gradient average gives the global mean:
    the objective does not depend on how the batch is split over ranks."""
    if not stats:
        raise ValueError("indexer_kl_loss needs indexer stats: run the model with collect_indexer_stats=True")
    rows = torch.stack([s.rows.float() for s in stats])
    if group is not None and dist.is_initialized():
        dist.all_reduce(rows, group=group)
    return sum(s.kl_sum * dp_size / r.clamp_min(1) for s, r in zip(stats, rows))


def sequence_aux_loss(stats: list[MoEStats]) -> torch.Tensor:
    """Mean over MoE layers of the sequence-level balance loss the layers computed."""
    return torch.stack([s.aux_loss for s in stats]).mean()


def routers(model: torch.nn.Module) -> list[Router]:
    """Routers in the order the model returns MoE stats (trunk layers, then MTP)."""
    return [m for m in model.modules() if isinstance(m, Router)]


@torch.no_grad()
def update_router_bias(
    model: torch.nn.Module, counts: list[torch.Tensor], *, rate: float, group: dist.ProcessGroup | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aux-loss-free balancing: bias_e += rate * sign(mean load - load_e), loads summed over the dp group; with
    `scale` (a device scalar, 0 or 1) the update is multiplied by it, so a skipped step is decided on the device.

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
        step = rate * torch.sign(m - load)
        if scale is not None:
            step = step * scale
        router.e_score_correction_bias.add_(step.to(router.e_score_correction_bias.device))
    return loads.max(-1).values / mean.squeeze(-1).clamp_min(1e-9)
