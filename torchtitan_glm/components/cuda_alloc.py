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

ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either (the second is the newer name)
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def default_alloc_conf(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set expandable segments when neither allocator variable is set; returns the setting in effect."""
    for name in ALLOC_ENV:
        if environ.get(name):
            return f"{name}={environ[name]}"
    environ[ALLOC_ENV[0]] = DEFAULT_ALLOC_CONF
    return f"{ALLOC_ENV[0]}={DEFAULT_ALLOC_CONF} (the trainer's default)"
