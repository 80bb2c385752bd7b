"""The planner's per-block activation inventories under context parallelism (planner/activations.py with cp=2)
against the tensors autograd keeps on each rank of a 2-rank gloo run (row zigzag; the DSA blocks keep the
all-gathered latent, pool the whole rows and run the indexer KL per zigzag chunk). Eager without AC and with full
AC; the selective policy's saves are not visible to saved-tensor hooks in eager mode, and the compiled partition
of a block with collectives is not traced here (those regimes are derived from the code, as the docs say)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.planner.activations import ActContext, saved

from ..unit.test_planner_activations import KINDS, SEQ, WIDTHS
from .test_train import _free_port

ROOT = Path(__file__).resolve().parents[2]
RUNS = {"none:dense": "eager", "none:sparse": "eager", "full:dense": "full"}


def _planned(regime: str, cp: int) -> dict[str, float]:
    args = get_flavor("debug").replace(**WIDTHS)
    ctx = ActContext(args=args, batch=1, seq=SEQ // cp, keys=SEQ, act=2, device="cpu", fp32_params=False, cp=cp,
                     sparse_kl=False)
    return {name: sum(saved(kind, regime, ctx).values()) for name, kind in KINDS.items()}


def test_cp_inventories_match_saved_tensors(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
           str(Path(__file__).with_name("_planner_cp_worker.py")), ",".join(RUNS)]
    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1", PLANNER_OUT=str(tmp_path),
               PYTHONPATH=str(ROOT))
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    for rank in range(2):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for run, regime in RUNS.items():
            planned, whole = _planned(regime, 2), _planned(regime, 1)
            for name, got in measured[run].items():
                assert got > 0, (run, name)
                # within 0.5% (as the single-process captures): the DSA blocks' whole-row terms are ~1.5% of them
                assert planned[name] == pytest.approx(got, rel=5e-3), (rank, run, name, got, planned[name])
                assert planned[name] < whole[name]  # per rank, the tokens are halved
