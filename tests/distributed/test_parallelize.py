"""FSDP2 (and tensor-parallel) recipe on 2 gloo ranks: BF16 compute with the FP32-kept parameters really FP32 in
forward (sharded per head under TP), and the replicated FP32 parameters staying identical across ranks after steps
on different data."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_train import _free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["fsdp", "tp"])
def test_bf16_keeps_declared_params_fp32_and_in_sync(mode):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
           str(Path(__file__).with_name("_parallel_worker.py")), mode]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    assert "rank 0 OK" in res.stdout and "rank 1 OK" in res.stdout
