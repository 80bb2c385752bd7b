"""Each [optimizer] choice trains the debug model through train.py (the loss goes down) and resumes exactly from a
checkpoint (TensorBoard's FP32 losses of the resumed steps equal the uninterrupted run's): torchao's AdamW8bit and
AdamWFp8, and AdamW with FSDP2's CPU offload. On this CPU machine the offload keeps host tensors on the host: the
plumbing and the checkpoints are what is tested here, not the moves off a GPU (no GPU test covers those yet).

torchao's compiled step takes about 60 s a run on 2 cores (it compiles a kernel per parameter shape), the fused one
(ops/adamw_lowbit.py's torch reference on CPU) does not compile; the config checks are in tests/unit/
test_optimizer.py and tests/unit/test_lowbit_step.py.
"""

from __future__ import annotations

import shutil

import pytest

from .test_train import _run_ok, _tb_losses

RUN = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "32", "--training.local_batch_size", "2",
       "--training.steps", "8", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
       "--checkpoint.enable", "true", "--checkpoint.interval", "4", "--metrics.enable_tensorboard", "true"]


def _trains_and_resumes_exactly(tmp_path, extra: list[str], *, timeout: int, resume_extra: list[str] | None = None,
                                rel: float = 0.0) -> None:
    """Trains 8 steps on 2 ranks, as the README's command does (the loss goes down; the optimizer states are sharded
    with the parameters), then resumes from step 4 with `resume_extra` (default `extra`): the resumed losses equal the
    uninterrupted run's, to `rel` (0: bit-exact)."""
    full = tmp_path / "full"
    out = _run_ok(RUN + extra + [f"--job.dump_folder={full}"], timeout=timeout).stdout
    losses = _tb_losses(full / "tb")
    assert sorted(losses) == list(range(1, 9)), out[-2000:]
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (6, 7, 8)) / 3
    assert last < first - 0.1, f"the loss did not go down: {first:.4f} -> {last:.4f}"

    part = tmp_path / "part"
    shutil.copytree(full / "checkpoint" / "step-4", part / "checkpoint" / "step-4")
    resume = extra if resume_extra is None else resume_extra
    out = _run_ok(RUN + resume + [f"--job.dump_folder={part}"], timeout=timeout).stdout
    assert "resumed from the step-4 checkpoint" in out
    resumed = _tb_losses(part / "tb")
    assert sorted(resumed) == [5, 6, 7, 8]
    for step in (5, 6, 7, 8):
        assert abs(resumed[step] - losses[step]) <= rel * abs(losses[step]), (
            f"step {step}: resumed {resumed[step]!r} != {losses[step]!r}")


@pytest.mark.long
def test_adamw_with_fsdp_cpu_offload(tmp_path):
    _trains_and_resumes_exactly(tmp_path, ["--optimizer.cpu_offload", "true"], timeout=300)


# torchao's compiled step takes about 60 s a run on 2 cores (2026-12-08): `long`
@pytest.mark.parametrize("name,impl", [("AdamW8bit", "fused"),
                                       pytest.param("AdamWFp8", "fused", marks=pytest.mark.long),
                                       pytest.param("AdamW8bit", "compiled", marks=pytest.mark.long),
                                       pytest.param("AdamWFp8", "compiled", marks=pytest.mark.long)])
def test_torchao_low_bit_adamw(tmp_path, name, impl):
    _trains_and_resumes_exactly(tmp_path, ["--optimizer.name", name, "--optimizer.implementation", impl],
                                timeout=900)


@pytest.mark.long
def test_low_bit_checkpoint_resumes_under_the_other_implementation(tmp_path):
    """A checkpoint of torchao's compiled AdamW8bit step resumes under the fused one (same states, same layout):
    the losses after the resume within 1e-5 of the uninterrupted compiled run's (the two steps agree to FP32
    rounding order, not bit for bit)."""
    _trains_and_resumes_exactly(tmp_path, ["--optimizer.name", "AdamW8bit", "--optimizer.implementation", "compiled"],
                                resume_extra=["--optimizer.name", "AdamW8bit"], timeout=900, rel=1e-5)
