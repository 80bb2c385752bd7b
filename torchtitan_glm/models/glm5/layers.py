"""Small building blocks shared by the GLM-5 blocks: RMSNorm, the clamped SwiGLU MLP, FP32-kept parameter holders."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_glm.ops.linear_cross_entropy import linear_cross_entropy


class RMSNorm(nn.Module):
    """RMSNorm computed in FP32, weight applied after casting back (the reference's order of operations)."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit): GLM-5's clamped SwiGLU (`swiglu_limit`)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class DenseMLP(nn.Module):
    """SwiGLU MLP with the swiglu_limit clamp (dense layers and the shared expert)."""

    def __init__(self, dim: int, hidden_dim: int, *, swiglu_limit: float, role: str = "mlp") -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        # Projection roles for float8.py: "mlp" (dense layers) or "shared_expert" (the MoE's always-on expert).
        self.linear_roles = {"gate_proj": role, "up_proj": role, "down_proj": role}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))

    def init_weights(self, *, std: float) -> None:
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=std)


def local_param(p: torch.Tensor) -> torch.Tensor:
    """The rank's piece of a parameter that a tensor-parallel plan made a DTensor (plain tensors pass through), for
    modules that compute on their rank's heads only: a sharded parameter gives its shard; a replicated one its full
    value, whose gradient is then a partial sum over the tensor-parallel ranks (DTensor reduces it)."""
    from torch.distributed.tensor import DTensor, Partial

    if isinstance(p, DTensor):
        return p.to_local(grad_placements=[Partial() if pl.is_replicate() else pl for pl in p.placements])
    return p


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """t in FP32, or in its own dtype where that is wider (fp64: gradcheck of the FP32-computing Functions)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def init_linear(linear: nn.Linear, *, std: float) -> None:
    """Reference init of every Linear: N(0, initializer_range), zero bias."""
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def fp32_kept_modules(root: nn.Module) -> list[nn.Module]:
    """Modules that declare `keep_fp32 = True`: their parameters stay FP32 under mixed precision (own FSDP group)."""
    return [m for m in root.modules() if getattr(m, "keep_fp32", False)]


class LMHead(nn.Module):
    """Output projection. Not an nn.Linear subclass on purpose: float8 conversion swaps nn.Linear subclasses and
    would drop the fused chunked cross-entropy. With labels it returns the loss, never the full logits."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                token_weights: torch.Tensor | None = None, *, chunk_size: int = 4096):
        if labels is None:
            return F.linear(hidden, self.weight)
        flat = hidden.reshape(-1, hidden.shape[-1])
        weights = torch.ones(flat.shape[0], device=flat.device) if token_weights is None else token_weights.reshape(-1)
        return linear_cross_entropy(flat, self.weight, labels.reshape(-1), weights, chunk_size=chunk_size)

    def init_weights(self, *, std: float) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=std)
