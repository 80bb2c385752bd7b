"""scripts/bench_decode.py: bad flags exit 2 with one line naming the flag, before any model is built; on CPU a
flavor whose FP32 parameters exceed half the available host memory is refused; a small run on the debug model."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _script():
    spec = importlib.util.spec_from_file_location("bench_decode", os.path.join(ROOT, "scripts", "bench_decode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refused(capsys, module, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("args,words", [
    (["--batch", "0"], "--batch"), (["--batch", "1,x"], "--batch"), (["--prompt-len", "0"], "--prompt-len"),
    (["--steps", "0"], "--steps"), (["--warmup", "-1"], "--warmup"), (["--flavor", "nonexist"], "--flavor"),
    (["--hf", "/nonexistent/hf"], "--hf"), (["--device", "cuda"], "--device cuda"),
])
def test_bad_arguments_exit_2_naming_the_flag(capsys, monkeypatch, args, words):
    module = _script()
    monkeypatch.setattr(module.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(module, "Glm5Model", None)  # nothing may be built before the flags are checked
    assert words in _refused(capsys, module, ["--flavor", "debug", "--device", "cpu", *args])


def test_hf_folder_without_a_checkpoint_exits_2(tmp_path, capsys):
    assert "--hf" in _refused(capsys, _script(), ["--hf", str(tmp_path), "--device", "cpu"])


def test_cpu_refuses_a_flavor_over_half_the_available_memory(capsys, monkeypatch):
    """The proxy (default flavor, ~7B parameters, ~26 GiB in FP32) on a host with 32 GiB available: refused before
    anything is materialised, pointing at --flavor debug; the debug flavor fits there."""
    module = _script()
    monkeypatch.setattr(module, "host_available_memory", lambda: 32 * 2**30)
    monkeypatch.setattr(module.Glm5Model, "to_empty", None)  # refused before any parameter is allocated
    line = _refused(capsys, module, ["--device", "cpu"])
    assert "--flavor glm5_3_flash_proxy" in line and "--flavor debug" in line and "32.0 GiB available" in line


def test_debug_run_on_cpu(tmp_path, monkeypatch):
    module = _script()
    monkeypatch.setattr(module, "host_available_memory", lambda: 32 * 2**30)
    out = tmp_path / "bench.json"
    rows = module.main(["--flavor", "debug", "--device", "cpu", "--dtype", "float32", "--batch", "1,2",
                        "--prompt-len", "8", "--steps", "2", "--warmup", "1", "--json", str(out)])
    assert [r["batch"] for r in rows] == [1, 2] and all(r["tokens_per_s"] > 0 for r in rows)
    assert json.loads(out.read_text())["runs"] == json.loads(json.dumps(rows))
    assert torch.get_default_dtype() == torch.float32
