"""`order_after(x, deps)`: a copy of x that exists only after every tensor in deps: an ordering edge in a compiled
graph.

Inductor orders kernels by data dependencies alone, and no public torch op states "after". In the fused LM-head CE's
chunk loop nothing makes chunk i+1 wait for chunk i's gradient GEMMs, and inductor scheduled later chunks' [chunk,
vocab] logits before it consumed earlier ones: 15 of the 16 chunks' logits, 17.7 GiB, were alive at once for the
proxy at T = 32,768 (H100 memory snapshot, docs/performance.md, thirty-first session). As a custom op the edge is
opaque to inductor, so no fusion or reordering removes it; it costs one copy of x (a [chunk, hidden] slice).
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("torchtitan_glm::order_after", mutates_args=())
def order_after(x: Tensor, deps: list[Tensor]) -> Tensor:
    """x copied; deps are only read as dependencies."""
    return x.clone()


@order_after.register_fake
def _(x: Tensor, deps: list[Tensor]) -> Tensor:
    return torch.empty_like(x)
