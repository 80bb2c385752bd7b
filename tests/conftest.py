"""Test-wide setup: quiet torchao's CUDA-extension loading on CPU machines before anything imports it; without CUDA,
hide FLA from transformers (its Triton KDA kernels cannot run on CPU tensors, and transformers picks them whenever
`fla` imports, e.g. on a CPU machine that has triton installed) so the reference takes its torch path. The
`world_of_one` fixture: a one-rank torchrun environment for tests that build the trainer in-process; `sdpa_calls`:
the shapes of every SDPA call."""

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
if not torch.cuda.is_available():
    sys.modules.setdefault("fla", None)


@pytest.fixture
def world_of_one():
    """torchrun's environment for one local rank on a free port (the trainer starts its own process group); the group
    and the environment are gone afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for k in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(k, None)


@pytest.fixture
def sdpa_calls(monkeypatch):
    """A list that gets (queries, keys, plain causal: is_causal with no mask) for every
    F.scaled_dot_product_attention call while the test runs."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[-2], k.shape[-2], bool(kw.get("is_causal", False)) and kw.get("attn_mask") is None))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls
