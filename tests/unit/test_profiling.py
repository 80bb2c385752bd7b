"""[profiling]: the trainer profiles exactly the configured window of steps and writes its trace and table; a window
past the run's end is a config error naming the key."""

from __future__ import annotations

import gzip
import json
import pytest
import torch

from types import SimpleNamespace

from torch.autograd import DeviceType

from torchtitan_glm.components.profiling import device_busy_us
from torchtitan_glm.config import ConfigError, load_config


def _cfg(tmp_path, *overrides: str):
    return load_config(["--config", "train_configs/debug_model.toml", "--training.seq_len", "32",
                        "--training.local_batch_size", "1", "--checkpoint.enable", "false",
                        "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1",
                        "--compile.enable", "false", f"--job.dump_folder={tmp_path}", *overrides])


def test_the_configured_steps_are_profiled(tmp_path, world_of_one, capsys):
    from torchtitan_glm.train import Trainer

    trainer = Trainer(_cfg(tmp_path, "--training.steps", "4", "--metrics.log_freq", "1", "--profiling.enable",
                           "true", "--profiling.start_step", "2", "--profiling.steps", "2",
                           "--profiling.row_limit", "5"))
    seen = []
    begin = trainer.profiler.begin
    trainer.profiler.begin = lambda step: (seen.append((step, trainer.profiler._prof is not None)), begin(step))
    losses = trainer.train()
    assert len(losses) == 4
    # active during steps 2 and 3 only: off when step 2 begins, on when step 3 begins, off again at step 4
    assert seen == [(1, False), (2, False), (3, True), (4, False)]
    folder = tmp_path / "profile_trace"
    with gzip.open(folder / "rank0_steps2-3.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(n.startswith("aten::") for n in names), "the trace holds the steps' operators"
    table = (folder / "ops.txt").read_text()
    assert table.startswith("profile: steps 2-3, wall ")
    lines = table.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("-----")]
    assert "Self CPU" in lines[rules[0] + 1]
    assert rules[2] - rules[1] - 1 == 5, "row_limit rows"
    out = capsys.readouterr().out
    assert "profile: steps 2-3" in out
    # the profiler's start, stop and export do not count in the next logged step's tokens/s
    tps = [float(line.split("| tps ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]
    assert tps[3] > tps[1] / 3, tps


def test_profiling_off_writes_nothing(tmp_path, world_of_one):
    from torchtitan_glm.train import Trainer

    Trainer(_cfg(tmp_path, "--training.steps", "2")).train()
    assert not (tmp_path / "profile_trace").exists()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_second_profile_into_the_same_folder_keeps_the_first(tmp_path, rank, capsys):
    """A re-run or a resume that profiles the same window writes beside the earlier files, never over them."""
    from torchtitan_glm.components.profiling import StepProfiler
    from torchtitan_glm.config import ProfilingConfig

    cfg = ProfilingConfig(enable=True, start_step=3, steps=1, row_limit=3)
    folder = tmp_path / "profile_trace"
    written = []
    for run in range(3):
        prof = StepProfiler(cfg=cfg, dump_folder=str(tmp_path), rank=rank, device=torch.device("cpu"))
        prof.begin(3)
        torch.ones(8).add_(run)
        assert prof.end(3)
        written.append(sorted(p.name for p in folder.iterdir()))
    traces = [f"rank{rank}_steps3-3.json.gz", f"rank{rank}_steps3-3.run2.json.gz", f"rank{rank}_steps3-3.run3.json.gz"]
    tables = ["ops.txt", "ops.run2.txt", "ops.run3.txt"] if rank == 0 else []
    assert written[-1] == sorted(traces + tables)
    assert [len(w) for w in written] == [len(written[-1]) // 3 * n for n in (1, 2, 3)], "one new set per run"
    if rank == 0:
        assert "ops.run3.txt in" in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("args, key", [
    (["--profiling.start_step", "4", "--profiling.steps", "2"], "profiling.start_step"),
    (["--profiling.steps", "0"], "profiling.steps"),
    (["--profiling.start_step", "0"], "profiling.start_step"),
])
def test_a_window_outside_the_run_names_the_key(tmp_path, args, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _cfg(tmp_path, "--training.steps", "4", "--profiling.enable", "true", *args)


def test_device_busy_is_the_union_of_kernel_intervals_without_annotations():
    def ev(start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               is_user_annotation=annotation)

    events = [ev(0, 10), ev(5, 12), ev(20, 25),  # two overlapping kernels (streams), then a gap: busy 12 + 5
              ev(0, 100, annotation=True),  # the optimizer's GPU-side range: not work
              ev(30, 90, device=DeviceType.CPU)]  # host ops
    assert device_busy_us(events) == 17
    assert device_busy_us([]) == 0


def test_a_resumed_run_past_the_window_is_told_so(tmp_path):
    from torchtitan_glm.components.profiling import StepProfiler
    from torchtitan_glm.config import ProfilingConfig

    cpu = torch.device("cpu")
    prof = StepProfiler(cfg=ProfilingConfig(enable=True, start_step=10, steps=2), dump_folder=str(tmp_path), rank=0,
                        device=cpu)
    assert prof.missed(1) is None and prof.missed(10) is None
    assert "profiling.start_step=10" in prof.missed(11)
    off = StepProfiler(cfg=ProfilingConfig(), dump_folder=str(tmp_path), rank=0, device=cpu)
    assert off.missed(50) is None
