"""Serving's FP8 indexer inputs, emulated in training: Hadamard rotation, then E4M3 with a power-of-two row scale.

The serving engines (SGLang `kpool_fp8_index`, vLLM glm5next) quantise the indexer query and the pooled keys this
way before the FP8 score GEMM: FP32 Hadamard (scaled d^-1/2) -> BF16 -> per-row absmax (floor 1e-4) -> scale
2^ceil(log2(absmax / 448)) -> clamp to +-448 -> E4M3. Training dequantises right away and lets the gradient pass
straight through the rounding (not through the rotation, which is linear and orthogonal), so the top-k it selects
is the one serving selects while the indexer still learns.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x @ H_d * d^-1/2 over the last dim (d a power of two, Sylvester order), as log2(d) butterfly stages.

    Hand-written: the fast-hadamard-transform CUDA package is not a dependency and has no CPU path; the butterflies
    are elementwise, so compile fuses them."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"hadamard_transform needs a power-of-two last dim, got {d}")
    out, h = x, 1
    while h < d:
        pairs = out.unflatten(-1, (d // (2 * h), 2, h))
        a, b = pairs.select(-2, 0), pairs.select(-2, 1)
        out = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return out * d**-0.5


def quantize_e4m3_pow2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values, FP32 power-of-two scale per row) of x, rows along the last dim: x ~ values * scale."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_serving_input(x: torch.Tensor) -> torch.Tensor:
    """The indexer input as serving quantises it (rotated), dequantised, with a straight-through gradient.

    x [..., d] (the indexer query per head, or a pooled key). Returns the rotated, FP8-rounded x in x's dtype;
    scores q.k are unchanged by the rotation (orthogonal), so only the FP8 rounding differs from the plain path."""
    rotated = hadamard_transform(x.float())
    values, scale = quantize_e4m3_pow2(rotated.to(torch.bfloat16))
    dequant = values.float() * scale
    return (rotated + (dequant - rotated).detach()).to(x.dtype)
