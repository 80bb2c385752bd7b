"""What autograd saves for backward, for the tests that check a function keeps no wide FP32 copy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def saved_for_backward() -> Iterator[list[torch.Tensor]]:
    """The tensors autograd saves inside the block, appended to the yielded list as they are saved (unchanged:
    the hooks hand every tensor back as it was)."""
    held: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        yield held
