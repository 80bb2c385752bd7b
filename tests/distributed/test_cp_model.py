"""The whole debug model under context parallelism (CP = 2 and 4, row zigzag, gloo) equals one process: losses,
indexer KL (dense and sparse forms) and every gradient, with packed documents crossing the ranks' chunks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_train import _free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nproc,kl,kernel",
                         [(2, "dense", "sparse"), (4, "sparse", "sparse"), (2, "sparse", "dense_dsa")])
def test_context_parallel_model_equals_one_process(nproc, kl, kernel):
    """kernel dense_dsa: the DSA selection through masked SDPA (model.dsa_dense_max_len), each rank's mask
    [B, T / cp, T] scattered from its queries' indices over the whole rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_free_port()}",
           str(Path(__file__).with_name("_cp_model_worker.py")), kl, kernel]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    assert all(f"rank {r} OK" in res.stdout for r in range(nproc))


@pytest.mark.long
def test_train_py_with_context_parallelism_equals_one_process(tmp_path):
    """debug_model_cp.toml (cp = 2 on 2 ranks, selective AC: the CP KDA op's outputs saved, the DSA all-gathers
    recomputed) through train.py: the same losses as one process without AC on the same rows."""
    from .test_train import _run_ok, _tb_losses

    common = ["--config", "train_configs/debug_model_cp.toml", "--training.steps", "4", "--lr_scheduler.warmup_steps",
              "1", "--metrics.log_freq", "1", "--checkpoint.enable", "false", "--training.seq_len", "64"]
    _run_ok(common + [f"--job.dump_folder={tmp_path / 'cp'}", "--activation_checkpoint.mode", "selective"], nproc=2)
    _run_ok(common + [f"--job.dump_folder={tmp_path / 'one'}", "--parallelism.context_parallel_degree", "1"], nproc=1)
    cp, one = _tb_losses(tmp_path / "cp" / "tb"), _tb_losses(tmp_path / "one" / "tb")
    assert sorted(cp) == sorted(one) == [1, 2, 3, 4]
    for step in cp:
        assert abs(cp[step] - one[step]) <= 2e-5 * abs(one[step]), (step, cp[step], one[step])
