"""Resharding resume through train.py: the step-10 checkpoint of the 2-rank FSDP reference run (dp=2, 2 rows per
rank) resumes under tensor parallelism (tp=2, 4 rows), one process (4 rows) and expert parallelism (ep=2 over the
dp ranks, 2 rows each): the same global batches follow, so every resumed step's loss equals the uninterrupted
run's to fp32 round-off (TP/EP/one process sum in another order), and the resume says what changed."""

from __future__ import annotations

import shutil

import pytest

from .test_reliability import PACKAGE_FRAME
from .test_train import SHORT, _losses, _run_ok, _tb_losses, _torchrun

LAYOUTS = {  # nproc, overrides (the global batch stays 4 rows)
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "one_process": (1, ["--training.local_batch_size", "4"]),
    "ep2": (2, ["--parallelism.expert_parallel_degree", "2"]),
    # 4 ranks, ep=2: two ranks hold each expert, and parallelism.expert_fsdp (the default) shards its rows over them
    "ep2_expert_fsdp": (4, ["--parallelism.expert_parallel_degree", "2", "--training.local_batch_size", "1"]),
}


# ep2 (~25 s) is slow-marked for CI time: EP's resharding (experts Shard(0) over ep, out of FSDP) is what the other
# two exercise for DTensors, and test_layouts.py checks EP against one process. one_process stays in the default
# suite; tp2 and ep2_expert_fsdp are `long` (CI runs them after it)
_MARKS = {"ep2": pytest.mark.slow, "tp2": pytest.mark.long, "ep2_expert_fsdp": pytest.mark.long}


@pytest.mark.parametrize("layout", [pytest.param(k, marks=_MARKS.get(k, ())) for k in LAYOUTS])
def test_resume_under_another_layout_continues_the_same_losses(tmp_path, reference_run, layout):
    full_dir, _ = reference_run
    dump = tmp_path / "run"
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(full_dir / "checkpoint" / "step-10", dump / "checkpoint" / "step-10")
    nproc, overrides = LAYOUTS[layout]
    res = _run_ok(SHORT + overrides + [f"--job.dump_folder={dump}", "--metrics.save_tb_folder=tb_resumed"],
                  nproc=nproc)
    assert sorted(_losses(res.stdout)) == list(range(11, 21))
    out = res.stdout + res.stderr
    assert "the parallel layout changed since the checkpoint (dp_replicate=1 dp_shard=2 cp=1 tp=1 ep=1 (world 2) ->" \
        in out, out[-3000:]
    assert "global batch changed" not in out
    full, resumed = _tb_losses(full_dir / "tb"), _tb_losses(dump / "tb_resumed")
    # step 11 runs on the loaded state: fp32 round-off only; later steps add Adam's updates of near-equal gradients
    assert resumed[11] == pytest.approx(full[11], rel=1e-6, abs=0)
    for step in range(12, 21):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=0), f"step {step}"


@pytest.mark.long
def test_a_tensor_parallel_checkpoint_resumes_under_fsdp(tmp_path):
    """The other direction: under tp=2 some parameters are plain tensors that FSDP makes DTensors, so the optimizer's
    param groups (plain and DTensor apart) hold other parameters than the checkpoint's. The resumed dp=2 run takes
    the saved settings by parameter and continues the tp=2 run's losses."""
    tp = LAYOUTS["tp2"][1]
    full = tmp_path / "tp2"
    _run_ok(SHORT + tp + [f"--job.dump_folder={full}"], nproc=2)
    dump = tmp_path / "run"
    (dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(full / "checkpoint" / "step-10", dump / "checkpoint" / "step-10")
    res = _run_ok(SHORT + [f"--job.dump_folder={dump}", "--metrics.save_tb_folder=tb_resumed"], nproc=2)
    assert sorted(_losses(res.stdout)) == list(range(11, 21))
    reference, resumed = _tb_losses(full / "tb"), _tb_losses(dump / "tb_resumed")
    assert resumed[11] == pytest.approx(reference[11], rel=1e-6, abs=0)
    for step in range(12, 21):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5, abs=0), f"step {step}"


def test_a_change_that_cannot_be_honoured_names_the_key(tmp_path, reference_run):
    """job.seed orders the documents: a resume with another seed cannot continue the data, and says so in one line."""
    full_dir, _ = reference_run
    dump = tmp_path / "run"
    shutil.copytree(full_dir / "checkpoint", dump / "checkpoint")
    res = _torchrun(SHORT + [f"--job.dump_folder={dump}", "--training.steps", "22", "--job.seed", "1"], nproc=1)
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "job.seed was 0, is 1 (it orders the documents); set it back" in errors[0], \
        res.stderr[-3000:]
    assert "failed to load" not in errors[0], "the loader's own line, not DCP's wrapper"
    assert "exitcode:2" in res.stderr.replace(" ", ""), res.stderr[-3000:]  # a setting to change
    assert PACKAGE_FRAME not in res.stderr + res.stdout, "an expected error prints no traceback"
