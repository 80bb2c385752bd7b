"""Parallel layouts on 2 and 4 gloo ranks equal one process: a few SGD steps of the debug model on one explicit
global batch give the same losses, gradients, parameters and router biases (fp32) under FSDP, TP, EP, FSDP x TP
and FSDP x EP (_layout_worker.py); the debug_model_2d / _ep configs train; bad layouts exit 2 naming the keys."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_train import STEP_LINE, _free_port, _run_ok

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1")


def _worker(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_free_port()}",
           str(Path(__file__).with_name("_layout_worker.py")), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)


SLOW = pytest.mark.slow
LONG = pytest.mark.long  # CI runs these after the default suite (pyproject.toml's markers)
LAYOUTS = [  # nproc, worker args: dp_shard tp ep [dp_replicate] [compile]
    pytest.param(2, ("2", "1", "1"), id="fsdp"),
    pytest.param(2, ("1", "2", "1"), id="tp"),
    pytest.param(2, ("1", "2", "1", "dense_dsa"), id="tp_dense_dsa_kernel", marks=LONG),
    pytest.param(2, ("2", "1", "2"), id="ep"),
    pytest.param(4, ("2", "2", "1"), id="fsdp_tp", marks=LONG),
    pytest.param(4, ("4", "1", "2"), id="fsdp_ep", marks=SLOW),  # whole experts (expert_fsdp off); CI time
    pytest.param(4, ("4", "1", "2", "expert_fsdp"), id="fsdp_ep_expert_fsdp", marks=LONG),
    pytest.param(4, ("2", "2", "2"), id="tp_ep", marks=SLOW),
    pytest.param(4, ("2", "1", "2", "2"), id="hsdp_ep", marks=SLOW),
    pytest.param(4, ("2", "1", "2", "2", "expert_fsdp"), id="hsdp_ep_expert_fsdp", marks=SLOW),
    pytest.param(2, ("1", "2", "1", "compile"), id="tp_compiled", marks=SLOW),  # ~3 min each on 2 cores
    pytest.param(2, ("2", "1", "2", "compile"), id="ep_compiled", marks=SLOW),
    pytest.param(4, ("4", "1", "2", "compile", "expert_fsdp"), id="fsdp_ep_expert_fsdp_compiled", marks=SLOW),
]


@pytest.mark.parametrize("nproc,args", LAYOUTS)
def test_layout_equals_single_process(nproc, args):
    res = _worker(nproc, *args)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    assert all(f"rank {r} OK" in res.stdout for r in range(nproc))


@pytest.mark.parametrize("config", ["debug_model_2d", "debug_model_ep"])
@pytest.mark.long
def test_parallel_configs_train(config, tmp_path):
    res = _run_ok(["--config", f"train_configs/{config}.toml", "--training.steps", "3", "--training.seq_len", "64",
                   "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", f"--job.dump_folder={tmp_path}",
                   "--checkpoint.enable", "false"], nproc=2)
    losses = [float(m.group(2)) for m in map(STEP_LINE.match, res.stdout.splitlines()) if m]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.parametrize("world,override,key", [
    ("4", ["--parallelism.data_parallel_shard_degree", "3"], "parallelism.data_parallel_shard_degree"),
    ("6", ["--parallelism.expert_parallel_degree", "3"], "parallelism.expert_parallel_degree"),  # 8 experts
])
def test_bad_layouts_exit_2_naming_the_key(world, override, key):
    # WORLD_SIZE as torchrun sets it; the check runs before any process group, so one process is enough
    res = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "train_configs/debug_model.toml",
                          *override], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(ENV, WORLD_SIZE=world, RANK="0"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert key in res.stderr and "Traceback" not in res.stderr


def test_float8_tensor_parallel_styles():
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                          f"--master-port={_free_port()}", str(Path(__file__).with_name("_float8_tp_worker.py"))],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
    assert "rank 0 OK" in res.stdout and "rank 1 OK" in res.stdout
