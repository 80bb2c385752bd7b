"""KDA and its short convolution under context parallelism on 2 and 4 gloo ranks equal CP = 1 (the whole rows on
one rank), forward and gradients, zigzag and contiguous slots, documents crossing rank boundaries."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_train import _free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nproc", [2, 4])
def test_kda_context_parallel_equals_single_rank(nproc):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_free_port()}",
           str(Path(__file__).with_name("_kda_cp_worker.py"))]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    assert all(f"rank {r} OK" in res.stdout for r in range(nproc))
