"""scripts/probe_layers.py: the eager-against-compiled layer probe finds the first diverging layer, and runs end to
end on the CPU (dynamo's eager backend) so a GPU session can rely on it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_loader import load_script

REPO = Path(__file__).resolve().parents[2]


def _row(loss, ce, *layers):
    return dict(loss=loss, ce_max=ce, layers={f"layer{i}": v for i, v in enumerate(layers)})


def test_first_divergence_names_the_first_layer_off(monkeypatch):
    probe = load_script("probe_layers", monkeypatch)
    ref = [_row(14.0, 18.0, 24.9, 33.0, 34.3), _row(14.0, 18.0, 24.9, 33.0, 34.3)]
    assert probe.first_divergence(ref, [_row(14.01, 18.0, 25.0, 33.1, 34.2)] * 2, rtol=0.05) is None
    assert probe.first_divergence(ref, [ref[0], _row(1.7e33, 3e36, 24.9, 2e30, math.inf)], rtol=0.05) == (1, "layer1")
    assert probe.first_divergence(ref, [_row(14.0, 18.0, 24.9, math.nan, 34.3)] * 2, rtol=0.05) == (0, "layer1")
    assert probe.first_divergence(ref, [_row(7.4e32, 18.0, 24.9, 33.0, 34.3)] * 2, rtol=0.05) == (0, "loss")


@pytest.mark.long
def test_script_runs_eager_and_compiled_on_cpu(tmp_path):
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "probe_layers.py"), "--flavor", "debug",
                           "--seq-len", "48", "--docs", "2", "--backend", "eager,aot_eager", "--json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=str(REPO), TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    eager = result["runs"]["eager"]
    for backend in ("eager", "aot_eager"):  # dynamo alone, then dynamo + AOTAutograd
        assert f"compiled:{backend} follows eager within rtol" in proc.stdout
        assert result["first_divergence"][backend] is None
        compiled = result["runs"][f"compiled:{backend}"]
        assert len(eager) == len(compiled) == 2
        assert list(eager[0]["layers"]) == list(compiled[0]["layers"]) and len(eager[0]["layers"]) >= 2
        assert all(0 < v < 1e3 for r in eager + compiled for v in r["layers"].values())
        assert math.isclose(eager[0]["loss"], compiled[0]["loss"], rel_tol=1e-3)


def test_script_refuses_the_proxy_without_cuda():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "probe_layers.py"), "--seq-len", "64"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1"))
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
