"""[profiling] on a GPU: the window's summary gives the device-busy time, which (kernels on one stream mostly) cannot
exceed the wall time; the table is sorted by CUDA time. The CPU counterpart is tests/unit/test_profiling.py."""

from __future__ import annotations

import re

import pytest
import torch

from tests.unit.test_host_syncs import _trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_profile_window_reports_device_busy_time(tmp_path, world_of_one):
    trainer = _trainer(tmp_path, "--training.steps", "4", "--metrics.log_freq", "1", "--compile.enable", "false",
                       "--profiling.enable", "true", "--profiling.start_step", "3", "--profiling.steps", "2")
    assert trainer.device.type == "cuda"
    trainer.train()
    summary = trainer.profiler.summary
    m = re.search(r"wall ([\d.]+) ms/step, device busy ([\d.]+) ms/step", summary or "")
    assert m, summary
    wall, busy = map(float, m.groups())
    assert 0 < busy <= wall * 1.02, (wall, busy)
    table = (tmp_path / "profile_trace" / "ops.txt").read_text()
    assert "Self CUDA" in table and (tmp_path / "profile_trace" / "rank0_steps3-4.json.gz").exists()


def test_memory_window_breaks_the_peak_down_by_source_line(tmp_path, world_of_one):
    """profiling.memory on the debug model: the snapshot loads, and the table's peak holds allocations of the
    project's own lines (the model's activations), above the bytes allocated before the window."""
    import pickle

    trainer = _trainer(tmp_path, "--training.steps", "3", "--metrics.log_freq", "1", "--compile.enable", "false",
                       "--profiling.memory", "true", "--profiling.start_step", "2", "--profiling.steps", "1")
    trainer.train()
    folder = tmp_path / "profile_trace"
    snapshot = pickle.loads((folder / "memory_rank0_steps2-2.pickle").read_bytes())
    assert any(e["action"] == "alloc" for e in snapshot["device_traces"][torch.cuda.current_device()])
    table = (folder / "memory.txt").read_text()
    assert re.search(r"GiB traced", table) and "torchtitan_glm/models/glm5/" in table, table
    # the reserve by stream pool, from the snapshot's segments: the default stream's pool holds the activations
    pools = re.findall(r"^\| (0|0x[0-9a-f]+) \| ([0-9.]+) \| ([0-9.]+) \|", table, re.M)
    default = [(float(r), float(a)) for st, r, a in pools if st == "0"]
    assert default and default[0][0] > 0 and default[0][0] >= default[0][1], table
    assert not (folder / "ops.txt").exists()  # enable off: no operator profile
    # the recording stopped with the window: a later allocation is not traced
    probe = torch.empty(7 * 2**20 + 1536, dtype=torch.uint8, device="cuda")
    traces = torch.cuda.memory._snapshot()["device_traces"]
    assert not any(e["action"] == "alloc" and e["size"] == probe.numel() for t in traces for e in t)
