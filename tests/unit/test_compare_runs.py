"""scripts/compare_runs.py: end-of-run loss means of two TensorBoard runs, their relative difference, the --max-rel
exit status, and errors that name the folder."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

_SPEC = importlib.util.spec_from_file_location("compare_runs",
                                               Path(__file__).parents[2] / "scripts" / "compare_runs.py")
compare_runs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(compare_runs)


def _run(path: Path, losses: dict[int, float]) -> str:
    w = SummaryWriter(str(path / "tb"))
    for step, v in losses.items():
        w.add_scalar("loss", v, step)
        w.add_scalar("grad_norm", 1.0, step)
    w.close()
    return str(path)


def test_end_means_and_relative_difference(tmp_path, capsys):
    a = {s: 6.0 - 0.02 * s for s in range(1, 201)}
    b = {s: v * 1.02 for s, v in a.items() if s % 2 == 0 or s > 150}  # b logged fewer steps early on
    ra, rb = _run(tmp_path / "a", a), _run(tmp_path / "b", b)
    assert compare_runs.main([ra, rb, "--last", "10", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    end = list(range(191, 201))
    want_a = sum(a[s] for s in end) / 10
    assert r["end_steps"] == [191, 200] and r["common_steps"] == 125
    assert r["end_mean_a"] == pytest.approx(want_a, rel=1e-6)
    assert r["end_rel_diff"] == pytest.approx(0.02, rel=1e-5)
    assert compare_runs.main([ra, rb, "--last", "10", "--max-rel", "0.01"]) == 1
    assert compare_runs.main([ra, rb, "--last", "10", "--max-rel", "0.03"]) == 0
    assert compare_runs.main([ra, ra, "--max-rel", "0"]) == 0  # a run against itself: no difference


def test_errors_name_the_folder(tmp_path, capsys):
    ra = _run(tmp_path / "a", {1: 2.0, 2: 1.5})
    with pytest.raises(SystemExit) as info:
        compare_runs.main([ra, str(tmp_path / "missing")])
    assert info.value.code == 2 and "missing" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as info:
        compare_runs.main([ra, str(tmp_path / "empty")])
    assert info.value.code == 2 and "no TensorBoard event files" in capsys.readouterr().err
    rc = _run(tmp_path / "c", {5: 1.0})
    with pytest.raises(SystemExit) as info:
        compare_runs.main([ra, rc])
    assert info.value.code == 2 and "no logged step" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        compare_runs.main([ra, ra, "--tag", "mtp_loss"])
    assert info.value.code == 2 and "mtp_loss" in capsys.readouterr().err


def test_reads_the_trainers_tensorboard_logger(tmp_path, capsys):
    """Events written by the trainer's own TensorBoardLogger (dump folder/tb, tensor values) are read back."""
    import torch

    from torchtitan_glm.components.metrics import TensorBoardLogger

    for name, scale in (("a", 1.0), ("b", 0.99)):
        tb = TensorBoardLogger(str(tmp_path / name / "tb"))
        for step in range(1, 31):
            tb.log({"loss": torch.tensor(3.0 / step * scale), "grad_norm": 1.0}, step)
        tb.close()
    assert compare_runs.main([str(tmp_path / "a"), str(tmp_path / "b"), "--last", "5", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["common_steps"] == 30 and r["end_rel_diff"] == pytest.approx(0.01, rel=1e-4)


def test_noise_floor_runs_and_the_floor_ratio(tmp_path, capsys):
    a = {s: 3.0 for s in range(1, 101)}
    ra = _run(tmp_path / "a", a)
    rb = _run(tmp_path / "b", {s: v * 1.03 for s, v in a.items()})  # 3% from a
    f1 = _run(tmp_path / "f1", {s: v * 0.98 for s, v in a.items()})  # 2% from a
    f2 = _run(tmp_path / "f2", {s: v * 1.01 for s, v in a.items()})  # 1%
    assert compare_runs.main([ra, rb, "--floor", f1, "--floor", f2, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["floor_rel_diffs"] == pytest.approx([0.02, 0.01], rel=1e-5)
    assert compare_runs.main([ra, rb, "--floor", f1, "--floor", f2, "--max-floor-ratio", "2"]) == 0  # 3% <= 2 x 2%
    assert compare_runs.main([ra, rb, "--floor", f1, "--floor", f2, "--max-floor-ratio", "1"]) == 1  # 3% > 2%
    assert "1 x the noise floor's 2.00%" in capsys.readouterr().err
    assert compare_runs.main([ra, rb, "--floor", f2, "--max-floor-ratio", "2"]) == 1  # 3% > 2 x 1%
    with pytest.raises(SystemExit) as info:
        compare_runs.main([ra, rb, "--max-floor-ratio", "2"])
    assert info.value.code == 2 and "--floor" in capsys.readouterr().err
    short = _run(tmp_path / "short", {s: 3.0 for s in range(1, 51)})  # ends before a and b: another end window
    with pytest.raises(SystemExit) as info:
        compare_runs.main([ra, rb, "--floor", short])
    assert info.value.code == 2 and "floor run ends at steps" in capsys.readouterr().err
