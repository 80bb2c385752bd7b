"""Fixtures of the unit tests."""

import os
import socket

import pytest
import torch.distributed as dist


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
