"""Each [optimizer] choice trains the debug model through train.py (the loss goes down) and resumes exactly from a
checkpoint (TensorBoard's FP32 losses of the resumed steps equal the uninterrupted run's): torchao's AdamW8bit and
AdamWFp8, and AdamW with FSDP2's CPU offload. On this CPU machine the offload keeps host tensors on the host: the
plumbing and the checkpoints are what is tested here, not the moves off a GPU (no GPU test covers those yet).

The torchao runs take 40-50 s each on 2 cores (their step compiles a kernel per parameter shape); the config checks
are in tests/unit/test_optimizer.py.
"""

from __future__ import annotations

import shutil

import pytest

from .test_train import _run_ok, _tb_losses

RUN = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "32", "--training.local_batch_size", "2",
       "--training.steps", "8", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
       "--checkpoint.enable", "true", "--checkpoint.interval", "4", "--metrics.enable_tensorboard", "true"]


def _trains_and_resumes_exactly(tmp_path, extra: list[str], *, timeout: int) -> None:
    full = tmp_path / "full"
    out = _run_ok(RUN + extra + [f"--job.dump_folder={full}"], nproc=1, timeout=timeout).stdout
    losses = _tb_losses(full / "tb")
    assert sorted(losses) == list(range(1, 9)), out[-2000:]
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (6, 7, 8)) / 3
    assert last < first - 0.1, f"the loss did not go down: {first:.4f} -> {last:.4f}"

    part = tmp_path / "part"
    shutil.copytree(full / "checkpoint" / "step-4", part / "checkpoint" / "step-4")
    out = _run_ok(RUN + extra + [f"--job.dump_folder={part}"], nproc=1, timeout=timeout).stdout
    assert "resumed from the step-4 checkpoint" in out
    resumed = _tb_losses(part / "tb")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert resumed[step] == losses[step], f"step {step}: resumed {resumed[step]!r} != {losses[step]!r}"


def test_adamw_with_fsdp_cpu_offload(tmp_path):
    _trains_and_resumes_exactly(tmp_path, ["--optimizer.cpu_offload", "true"], timeout=300)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamWFp8"])
def test_torchao_low_bit_adamw(tmp_path, name):
    _trains_and_resumes_exactly(tmp_path, ["--optimizer.name", name], timeout=900)
