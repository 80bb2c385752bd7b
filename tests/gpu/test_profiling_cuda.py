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
