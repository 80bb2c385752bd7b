"""Grouped GEMM over token groups sorted by expert: torch._grouped_mm where it runs, a per-expert loop otherwise.

torch._grouped_mm (torch >= 2.11) runs fp32/bf16 on CPU and bf16 on CUDA; the loop keeps other dtypes working.
"""

from __future__ import annotations

import torch


def _grouped_mm_supported(x: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, K] rows sorted by group, w [G, K, M], offs [G] int32 cumulative row ends -> [N, M]."""
    if _grouped_mm_supported(x):
        return torch._grouped_mm(x, w, offs=offs)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    ends = offs.tolist()
    begin = 0
    for g, end in enumerate(ends):
        if end > begin:
            out[begin:end] = x[begin:end] @ w[g]
        begin = end
    return out
