"""The gradients of the parameters kept out of FSDP2 (FP32-kept maps, gates and norms), averaged by bucketed
all-reduces launched during backward, equal a single process's on the whole batch (2 gloo ranks; AVG and the
SUM + multiply fallback), and the comparison fails for a sum (_replicated_grads_worker.py)."""

import os
import subprocess
import sys
from pathlib import Path

from .test_train import _free_port

ROOT = Path(__file__).resolve().parents[2]


def test_replicated_gradients_equal_one_process_and_overlap_backward():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
           str(Path(__file__).with_name("_replicated_grads_worker.py"))]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    assert "rank 0 OK" in res.stdout and "rank 1 OK" in res.stdout
