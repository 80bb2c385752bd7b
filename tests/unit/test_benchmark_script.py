"""scripts/benchmark.py runs end to end on the debug flavor (both scopes, with AC) and writes one row per run:
the GPU sessions depend on it, and they are too short to find a broken script there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scope", ["train", "reference"])
def test_benchmark_script_writes_one_row_per_run(tmp_path, scope):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--flavor", "debug", "--seq-len", "64", "--steps", "1",
         "--warmup", "1", "--runs", "eager:none,eager:selective:fp8", "--scope", scope, "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["ac"], r["scope"], r["float8"]) for r in rows] == [
        ("eager", "none", scope, "off"), ("eager", "selective", scope, "tensorwise")]
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert f"scope: {scope}" in proc.stdout
