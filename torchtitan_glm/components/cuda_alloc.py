"""The CUDA caching allocator's setting for training: expandable segments unless the user chose otherwise.

Why: in eager mode the proxy's T = 65,536 step ran out of memory on a 139 GiB H200 with about 105 GiB allocated
(docs/performance.md, long-context section). The rest sat in cached blocks of the wrong sizes. Expandable
segments grow one mapping in place, so freed memory can be reused at any size. TorchTitan's launch script sets the
same. The allocator reads the variable once, at its first CUDA allocation, so this runs before anything touches
the device.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either (the second is the newer name)
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def default_alloc_conf(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set expandable segments when neither allocator variable is set; returns the setting in effect."""
    for name in ALLOC_ENV:
        if environ.get(name):
            return f"{name}={environ[name]}"
    environ[ALLOC_ENV[0]] = DEFAULT_ALLOC_CONF
    return f"{ALLOC_ENV[0]}={DEFAULT_ALLOC_CONF} (the trainer's default)"


def memory_limit_error(limit_gib: float, *, total_bytes: int | None) -> str | None:
    """Why training.device_memory_limit_gib cannot apply on this host (None: it can). total_bytes: the card's memory,
    None without CUDA."""
    if total_bytes is None:
        return "caps CUDA memory and this host has no CUDA device; set it to 0"
    if limit_gib * 2**30 > total_bytes:
        return f"is {limit_gib:g} GiB and the device has {total_bytes / 2**30:.1f} GiB"
    return None


def limit_device_memory(limit_gib: float, device: torch.device) -> float:
    """Cap what this process may reserve on `device` at `limit_gib` (training.device_memory_limit_gib, checked
    first by memory_limit_error); returns the fraction of the card set. An allocation that would pass the cap makes
    the caching allocator release its cached blocks and retry, as it does before an out-of-memory error, so the
    reserve stays under the cap (at the cost of that release when it happens)."""
    fraction = limit_gib * 2**30 / torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
