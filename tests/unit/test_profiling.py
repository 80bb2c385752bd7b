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


def test_memory_recording_off_cuda_names_the_key(tmp_path):
    """profiling.memory records CUDA allocations: on a host without CUDA train.py stops before starting (exit 2),
    naming the key; its window is checked against the run like enable's."""
    from torchtitan_glm.train import check_layout

    if torch.cuda.is_available():
        pytest.skip("the refusal is for hosts without CUDA")
    with pytest.raises(ConfigError, match=r"profiling\.memory.*no CUDA device"):
        check_layout(_cfg(tmp_path, "--profiling.memory", "true", "--profiling.start_step", "1"))
    with pytest.raises(ConfigError, match=r"profiling\.start_step"):
        _cfg(tmp_path, "--training.steps", "4", "--profiling.memory", "true", "--profiling.start_step", "4",
             "--profiling.steps", "2")


class _FakeCudaMemory:
    """torch.cuda's memory history on a host without CUDA: a fixed trace, so that the window's bookkeeping (when
    recording starts and stops, what is written where, the out-of-memory path, no file overwritten) is checked on
    CPU; the recording itself runs in tests/gpu/test_profiling_cuda.py."""

    def __init__(self, trace):
        self.trace, self.calls = trace, []

    def install(self, monkeypatch):
        cuda, mem = torch.cuda, torch.cuda.memory
        monkeypatch.setattr(mem, "_record_memory_history", lambda enabled="all", **kw: self.calls.append(enabled))
        monkeypatch.setattr(mem, "_snapshot", lambda: {"device_traces": [list(self.trace)], "segments": []})
        for name, value in (("memory_allocated", 3 * 2**30), ("max_memory_allocated", 5 * 2**30),
                            ("max_memory_reserved", 6 * 2**30)):
            monkeypatch.setattr(cuda, name, lambda device=None, v=value: v)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)


def _trace():
    frames = [{"filename": "/r/torchtitan_glm/models/glm5/moe.py", "line": 7, "name": "forward"}]
    return [{"action": "alloc", "addr": 1, "size": 2**30, "frames": frames},
            {"action": "alloc", "addr": 2, "size": 2**29, "frames": frames},
            {"action": "free_completed", "addr": 1, "size": 2**30, "frames": []}]


def test_memory_window_writes_snapshot_and_table_and_keeps_earlier_ones(tmp_path, monkeypatch, capsys):
    import pickle

    from torchtitan_glm.components.profiling import StepProfiler
    from torchtitan_glm.config import ProfilingConfig

    fake = _FakeCudaMemory(_trace())
    fake.install(monkeypatch)
    cfg = ProfilingConfig(memory=True, start_step=2, steps=2)
    for run in (1, 2):
        with StepProfiler(cfg=cfg, dump_folder=str(tmp_path), rank=0, device=torch.device("cuda")) as prof:
            for step in (1, 2, 3, 4):
                prof.begin(step)
                assert prof.end(step) == (step == 3)
    assert fake.calls == ["all", None, "all", None]  # on at the window's first step, off after its last, twice
    folder = tmp_path / "profile_trace"
    assert sorted(p.name for p in folder.iterdir()) == [
        "memory.run2.txt", "memory.txt", "memory_rank0_steps2-3.pickle", "memory_rank0_steps2-3.run2.pickle"]
    assert pickle.loads((folder / "memory_rank0_steps2-3.pickle").read_bytes())["device_traces"][0] == _trace()
    table = (folder / "memory.txt").read_text()
    assert "allocated before the window (not in the table) 3.00 GiB" in table and "reserved 6.00 GiB" in table
    assert "1.50 GiB traced" in table and "| 1.500 | 2 | torchtitan_glm/models/glm5/moe.py:7 forward |" in table
    assert "memory: steps 2-3" in capsys.readouterr().out


def test_an_out_of_memory_inside_the_window_writes_its_snapshot(tmp_path, monkeypatch):
    from torchtitan_glm.components.profiling import StepProfiler
    from torchtitan_glm.config import ProfilingConfig

    oom = {"action": "oom", "addr": 0, "size": 2**32, "frames": []}
    fake = _FakeCudaMemory(_trace() + [oom])
    fake.install(monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):  # on rank 1: the failing rank writes its own table
        with StepProfiler(cfg=ProfilingConfig(memory=True, start_step=1, steps=3), dump_folder=str(tmp_path),
                          rank=1, device=torch.device("cuda")) as prof:
            prof.begin(1)
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert fake.calls == ["all", None]
    folder = tmp_path / "profile_trace"
    assert sorted(p.name for p in folder.iterdir()) == ["memory_rank1_oom.pickle", "memory_rank1_oom.txt"]
    table = (folder / "memory_rank1_oom.txt").read_text()
    assert "memory: an out-of-memory on rank 1" in table and "| 4.000 | 1 | (the failed request) |" in table
    # an error raised from an out-of-memory (a compile error wrapping it) counts as one
    fake.calls.clear()
    with pytest.raises(RuntimeError):
        with StepProfiler(cfg=ProfilingConfig(memory=True, start_step=1, steps=3), dump_folder=str(tmp_path),
                          rank=1, device=torch.device("cuda")) as prof:
            prof.begin(1)
            try:
                raise torch.OutOfMemoryError("CUDA out of memory")
            except torch.OutOfMemoryError as e:
                raise RuntimeError("backend compiler failed") from e
    assert fake.calls == ["all", None] and (folder / "memory_rank1_oom.run2.txt").exists()
    # another error inside the window stops the recording and writes nothing
    fake.calls.clear()
    with pytest.raises(RuntimeError):
        with StepProfiler(cfg=ProfilingConfig(memory=True, start_step=1, steps=3), dump_folder=str(tmp_path / "b"),
                          rank=0, device=torch.device("cuda")) as prof:
            prof.begin(1)
            raise RuntimeError("a data error")
    assert fake.calls == ["all", None] and not (tmp_path / "b").exists()
