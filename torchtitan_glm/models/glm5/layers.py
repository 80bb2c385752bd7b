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


# The recomputing backwards of the Functions that hold BF16 inputs (SwiGLU here, mhc.rms_linear, the KDA pieces):
# each FP32 intermediate one chunk recomputes has at most this many elements (256 MiB).
BWD_CHUNK_ELEMENTS = 1 << 26


def bwd_chunks(items: int, elements_per_item: int) -> list[slice]:
    """Slices over `items` (rows, or channels) for a chunked backward, at most BWD_CHUNK_ELEMENTS elements each."""
    step = max(1, BWD_CHUNK_ELEMENTS // max(1, elements_per_item))
    return [slice(s, s + step) for s in range(0, items, step)]


class _SwiGLU(torch.autograd.Function):
    """silu(min(gate, L)) clamp(up, -L, L), saving gate and up only.

    Autograd of the plain expression keeps the clamped gate, the SiLU output and the clamped up besides the inputs
    (five tensors of the MLP's width in all): 9 GiB more than gate and up for the proxy's dense MLP at T = 128K in
    an eager backward. The backward recomputes in row chunks, in FP32, with the clamps' gradient masks as autograd's
    (inclusive bounds): d gate = g uc silu'(gc) [gate <= L], d up = g silu(gc) [-L <= up <= L]."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        ctx.limit = limit
        ctx.save_for_backward(gate, up)
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        limit, width = ctx.limit, gate.shape[-1]
        acc = torch.promote_types(gate.dtype, torch.float32)
        gs, us, os_ = gate.reshape(-1, width), up.reshape(-1, width), grad_out.reshape(-1, width)
        d_gate, d_up = torch.empty_like(gs), torch.empty_like(us)
        for part in bwd_chunks(gs.shape[0], width):
            g, u, go = gs[part].to(acc), us[part].to(acc), os_[part].to(acc)
            gc = g.clamp(max=limit)
            sg = torch.sigmoid(gc)
            d_silu = sg * (1 + gc * (1 - sg))
            d_gate[part] = (go * u.clamp(min=-limit, max=limit) * d_silu * (g <= limit)).to(gate.dtype)
            d_up[part] = (go * gc * sg * ((u >= -limit) & (u <= limit))).to(up.dtype)
        return d_gate.view(gate.shape), d_up.view(up.shape), None


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) * clamp(up, -limit, limit): GLM-5's clamped SwiGLU (`swiglu_limit`); backward holds
    gate and up only (_SwiGLU)."""
    return _SwiGLU.apply(gate, up, limit)


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
