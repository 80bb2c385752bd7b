"""FLA's CUDA context-parallel KDA path (ops/kda_cp.py) on 2 NCCL ranks equals the whole-row reference. Needs two
GPUs, or NCCL accepting two ranks on one GPU (it usually refuses: "Duplicate GPU detected"; then the test skips)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .test_kda_fla import _fla_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fla_usable(), reason="needs CUDA and fla-core with triton")]
ROOT = Path(__file__).resolve().parents[2]


def test_fla_context_parallel_kda_matches_whole_rows():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
           str(Path(__file__).with_name("_kda_cp_gpu_worker.py"))]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    out = res.stdout + res.stderr
    if res.returncode != 0 and torch.cuda.device_count() < 2 and "Duplicate GPU" in out:
        pytest.skip("NCCL refuses two ranks on one GPU; needs 2 GPUs")
    print(res.stdout)
    assert res.returncode == 0, out[-8000:]
    assert "rank 0 OK" in res.stdout and "rank 1 OK" in res.stdout
