"""CheckpointManager in one process without a process group: exact resume, RNG, retention, crash leftovers, errors."""

from __future__ import annotations

import errno
import os
import random
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from torchtitan_glm.config import CheckpointConfig
from torchtitan_glm.components.checkpoint import CheckpointManager, NonFiniteError, list_checkpoints, step_dir
from torchtitan_glm.components.errors import CheckpointError, ResumeMismatchError

from tests.distributed._ckpt_worker import _train  # one training loop for the local and the torchrun tests

# DCP warns on every save/load without a process group, even when asked for no_dist explicitly.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _Cfg(**overrides) -> CheckpointConfig:  # noqa: N802 - reads like the dataclass it builds
    """The real [checkpoint] section, enabled and saving every step unless overridden."""
    return CheckpointConfig(**{"enable": True, "interval": 1, **overrides})


class _CounterLoader:
    """A stateful fake dataloader: batch i is a pure function of its position i."""

    def __init__(self) -> None:
        self.pos = 0

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + self.pos)
        self.pos += 1
        return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def _build(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    return model, opt, sched, _CounterLoader()


def _manager(tmp_path, parts, cfg: CheckpointConfig | None = None, **kw) -> CheckpointManager:
    model, opt, sched, dl = parts
    return CheckpointManager(cfg=cfg or _Cfg(), dump_folder=str(tmp_path), model=model, optimizer=opt,
                             lr_scheduler=sched, dataloader=dl, **kw)


def _draws() -> tuple[list[float], float, float]:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_resume_is_bit_identical(tmp_path, async_mode):
    root = tmp_path / "checkpoint"
    cfg = _Cfg(async_mode=async_mode)
    run_a = _build(seed=0)
    mgr = _manager(tmp_path, run_a, cfg)
    _train(*run_a, 3)
    assert mgr.save(3)
    draws_a = _draws()
    losses_a = _train(*run_a, 2)  # in async mode this mutates the weights while the save may still be writing
    if async_mode == "async":
        assert not (root / "step-3").exists(), "an async checkpoint is published only when it is waited for"
    mgr.close()
    assert list_checkpoints(str(root)) == [3]
    assert not (root / "step-3.tmp").exists()

    run_b = _build(seed=1)  # different initial weights: only the checkpoint can make the runs agree
    assert not torch.equal(run_b[0][0].weight, run_a[0][0].weight)
    mgr_b = _manager(tmp_path, run_b, cfg)
    assert mgr_b.load() == 3
    assert run_b[3].pos == 3 and run_b[2].last_epoch == 3
    assert _draws() == draws_a
    assert _train(*run_b, 2) == losses_a
    for pa, pb in zip(run_a[0].parameters(), run_b[0].parameters()):
        assert torch.equal(pa, pb)
    mgr_b.close()


def test_interval_keep_latest_k_and_last(tmp_path):
    parts = _build(seed=0)
    mgr = _manager(tmp_path, parts, _Cfg(interval=2, keep_latest_k=2))
    saved = [s for s in range(1, 7) if mgr.save(s)]
    assert saved == [2, 4, 6]
    root = str(tmp_path / "checkpoint")
    assert list_checkpoints(root) == [4, 6]
    assert mgr.save(7, last=True)
    assert list_checkpoints(root) == [6, 7]
    assert sorted(os.listdir(root)) == ["step-6", "step-7"]


def test_keep_all_and_disabled(tmp_path):
    parts = _build(seed=0)
    mgr = _manager(tmp_path, parts, _Cfg(interval=1, keep_latest_k=0))
    for s in range(1, 5):
        mgr.save(s)
    assert list_checkpoints(str(tmp_path / "checkpoint")) == [1, 2, 3, 4]

    off = _manager(tmp_path / "off", parts, _Cfg(enable=False))
    assert not off.save(5) and not off.save(6, last=True)
    assert not (tmp_path / "off").exists()
    assert off.load() is None


def test_crash_leftover_tmp_is_ignored_then_cleaned(tmp_path):
    root = tmp_path / "checkpoint"
    run_a = _build(seed=0)
    mgr = _manager(tmp_path, run_a)
    _train(*run_a, 2)
    mgr.save(2)
    ref = {k: v.clone() for k, v in run_a[0].state_dict().items()}
    # A save of step 5 that died mid-write: even its .metadata is there (crash just before the rename), but one
    # data file is truncated. Plus a step folder without .metadata: neither is a complete checkpoint.
    shutil.copytree(root / "step-2", root / "step-5.tmp")
    data = next(p for p in (root / "step-5.tmp").iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:10])
    (root / "step-4").mkdir()
    (root / "step-4" / "__0_0.distcp").write_bytes(b"partial")
    assert list_checkpoints(str(root)) == [2]

    run_b = _build(seed=1)
    mgr_b = _manager(tmp_path, run_b)
    assert mgr_b.load() == 2
    for k, v in run_b[0].state_dict().items():
        assert torch.equal(v, ref[k])
    assert mgr_b.save(6)
    assert not (root / "step-5.tmp").exists(), "the next save removes crash leftovers"
    assert list_checkpoints(str(root)) == [2, 6]


def test_missing_or_corrupt_step_errors_name_the_path(tmp_path):
    root = tmp_path / "checkpoint"
    parts = _build(seed=0)
    mgr = _manager(tmp_path, parts)
    mgr.save(1)
    with pytest.raises(CheckpointError, match=f"{root / 'step-9'} does not exist"):
        mgr.load(step=9)
    (root / "step-3").mkdir()
    with pytest.raises(RuntimeError, match=f"{root / 'step-3'}.*incomplete"):
        mgr.load(step=3)
    data = next(p for p in (root / "step-1").iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(RuntimeError, match=str(root / "step-1")):
        mgr.load(step=1)


def test_fresh_run_returns_none(tmp_path):
    parts = _build(seed=0)
    before = [p.clone() for p in parts[0].parameters()]
    assert _manager(tmp_path, parts).load() is None
    assert all(torch.equal(a, b) for a, b in zip(before, parts[0].parameters()))


def test_resave_same_step_replaces_it(tmp_path):
    parts = _build(seed=0)
    mgr = _manager(tmp_path, parts)
    mgr.save(3)
    _train(*parts, 1)
    mgr2 = _manager(tmp_path, parts)  # a new manager (e.g. a rerun) saving an existing step again
    assert mgr2.save(3)
    expect = [p.clone() for p in parts[0].parameters()]
    fresh = _build(seed=1)
    assert _manager(tmp_path, fresh).load() == 3
    assert all(torch.equal(a, b) for a, b in zip(expect, fresh[0].parameters()))
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-3"]


def test_initial_load_from_dcp_is_model_only(tmp_path):
    src = _build(seed=0)
    _train(*src, 2)
    _manager(tmp_path / "src", src).save(2)
    path = step_dir(str(tmp_path / "src" / "checkpoint"), 2)

    dst = _build(seed=1)
    mgr = _manager(tmp_path / "dst", dst, _Cfg(initial_load_path=path))
    assert mgr.load() is None  # a fresh run that starts from given weights
    for pa, pb in zip(src[0].parameters(), dst[0].parameters()):
        assert torch.equal(pa, pb)
    assert len(dst[1].state) == 0 and dst[3].pos == 0 and dst[2].last_epoch == 0

    # A bare model state dict (no "model." prefix), as other tools write it.
    bare = tmp_path / "bare"
    torch.distributed.checkpoint.save(src[0].state_dict(), checkpoint_id=str(bare))
    dst2 = _build(seed=2)
    assert _manager(tmp_path / "dst2", dst2, _Cfg(initial_load_path=str(bare))).load() is None
    for pa, pb in zip(src[0].parameters(), dst2[0].parameters()):
        assert torch.equal(pa, pb)

    # Once the run has its own checkpoint, that wins over initial_load_path.
    _train(*dst, 1)
    mgr.save(3)
    again = _build(seed=3)
    assert _manager(tmp_path / "dst", again, _Cfg(initial_load_path=path)).load() == 3
    for pa, pb in zip(dst[0].parameters(), again[0].parameters()):
        assert torch.equal(pa, pb)


def test_initial_load_into_another_model_names_what_does_not_fit(tmp_path):
    """Weights of another architecture (e.g. a run with model.hc_head = "learned", whose head has parameters) stop
    in one line naming the tensors, not in DCP's multi-kilobyte traceback."""
    src = _build(seed=0)
    _manager(tmp_path / "src", src).save(1)
    path = step_dir(str(tmp_path / "src" / "checkpoint"), 1)
    model, opt, sched, dl = _build(seed=1)
    model.append(nn.Linear(2, 3))  # a tensor the checkpoint lacks
    model[0] = nn.Linear(8, 16, bias=False)  # one it holds that this model lacks
    model[3] = nn.Linear(16, 4)  # other shapes
    opt = torch.optim.AdamW(model.parameters())
    mgr = _manager(tmp_path / "dst", (model, opt, sched, dl), _Cfg(initial_load_path=path))
    with pytest.raises(CheckpointError) as info:
        mgr.load()
    text = str(info.value)
    assert "\n" not in text and len(text) < 600, text
    assert text.startswith(f"checkpoint.initial_load_path {path} does not fit this model: it lacks 2 of this "
                           "model's tensors (e.g. 4.bias, 4.weight); it holds 1 tensors this model does not have "
                           "(e.g. 0.bias); 2 tensors differ in shape (e.g. 3.bias: saved [2], this model [4])"), text


def test_hf_hooks(tmp_path):
    calls = []
    root = tmp_path / "checkpoint"

    def hf_load(model, path):
        calls.append(("load", model, path))

    def hf_save(model, out_dir):
        calls.append(("save", model, out_dir, list_checkpoints(str(root))))

    parts = _build(seed=0)
    cfg = _Cfg(interval=5, initial_load_path=str(tmp_path), initial_load_in_hf=True, last_save_in_hf=True)
    mgr = _manager(tmp_path, parts, cfg, hf_load_fn=hf_load, hf_save_fn=hf_save)
    assert mgr.load() is None
    assert calls == [("load", parts[0], str(tmp_path))]
    assert mgr.save(5) and len(calls) == 1  # not the last save: no export
    assert mgr.save(5, last=True)  # already saved by the interval: only the export runs
    assert calls[1] == ("save", parts[0], str(root / "hf-step-5"), [5])
    with pytest.raises(ValueError, match="hf_save_fn"):
        _manager(tmp_path, parts, cfg, hf_load_fn=hf_load)


def test_a_failed_final_export_is_one_line_naming_what_is_kept(tmp_path):
    """A full disk at the model-only final export: one line naming the export folder and the newest checkpoint that
    survives (it was a traceback, and nothing said that steps after that checkpoint were lost)."""
    def full_disk(model, out_dir):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out_dir))

    root = tmp_path / "checkpoint"
    mgr = _manager(tmp_path, _build(seed=0), _Cfg(interval=3, last_save_in_hf=True, last_save_model_only=True),
                   hf_save_fn=full_disk)
    assert mgr.save(3)
    with pytest.raises(CheckpointError) as info:
        mgr.save(6, last=True)
    assert str(info.value) == (f"the HF export of step 6 into {root / 'hf-step-6'} failed: No space left on device "
                               f"({root / 'hf-step-6'}); the newest checkpoint kept is {root / 'step-3'}")


def test_a_checkpoint_folder_that_cannot_be_created_is_one_line(tmp_path):
    """The first save creates the checkpoint folder: when that fails (a read-only file system, a file in the way),
    the error is the save's one line, not a traceback from the folder's creation."""
    (tmp_path / "dump").write_text("a file where the dump folder should be")
    mgr = _manager(tmp_path / "dump", _build(seed=0))
    with pytest.raises(CheckpointError, match=r"^checkpoint save of step 1 into .*step-1\.tmp failed: Not a directory"):
        mgr.save(1)


def test_last_save_model_only_writes_the_hf_export_alone(tmp_path):
    root = tmp_path / "checkpoint"
    exported = []

    def hf_save(model, out_dir):
        exported.append((out_dir, list_checkpoints(str(root))))

    parts = _build(seed=0)
    cfg = _Cfg(interval=2, last_save_in_hf=True, last_save_model_only=True)
    mgr = _manager(tmp_path, parts, cfg, hf_save_fn=hf_save)
    assert mgr.save(2)  # an interval save is the full DCP state, as always
    _train(*parts, 1)
    assert mgr.save(3, last=True)
    assert exported == [(str(root / "hf-step-3"), [2])]  # no step-3 DCP folder, before or after the export
    assert list_checkpoints(str(root)) == [2]
    # a non-finite model is not exported either
    with torch.no_grad():
        next(parts[0].parameters())[0] = float("nan")
    with pytest.raises(NonFiniteError):
        mgr.save(4, last=True)
    assert len(exported) == 1


# ------------------------------------------------------------------------------------ verified checkpoints
def _flip(path, n: int = 4096) -> None:
    """Invert n bytes in the middle of `path` (tensor payload, not the zip headers DCP would notice)."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2
    end = min(len(data), offset + n)
    data[offset:end] = bytes(b ^ 0xFF for b in data[offset:end])
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_with_its_checksum(tmp_path):
    import hashlib
    import json

    parts = _build(seed=0)
    _manager(tmp_path, parts, run_info={"what": "test"}).save(1)
    folder = tmp_path / "checkpoint" / "step-1"
    manifest = json.loads((folder / "manifest.json").read_text())
    on_disk = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk and ".metadata" in on_disk and "run.json" in on_disk
    for name, entry in manifest["files"].items():
        blob = (folder / name).read_bytes()
        assert entry == {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    assert json.loads((folder / "run.json").read_text()) == {"what": "test"}


def test_flipped_bytes_in_the_newest_checkpoint_fall_back_to_the_previous_one(tmp_path, caplog):
    root = tmp_path / "checkpoint"
    run_a = _build(seed=0)
    mgr = _manager(tmp_path, run_a)
    _train(*run_a, 2)
    mgr.save(2)
    ref = {k: v.clone() for k, v in run_a[0].state_dict().items()}
    _train(*run_a, 2)
    mgr.save(4)
    data = next(p for p in (root / "step-4").iterdir() if p.suffix == ".distcp")
    _flip(data)

    run_b = _build(seed=1)
    with caplog.at_level("WARNING", logger="torchtitan_glm.components.checkpoint"):
        assert _manager(tmp_path, run_b).load() == 2
    for k, v in run_b[0].state_dict().items():
        assert torch.equal(v, ref[k]), k
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert f"{root / 'step-4'} (is corrupt: {data.name} does not match its checksum)" in warnings[0]
    assert "resuming from step-2" in warnings[0]
    # Asked for explicitly, the corrupt one is an error naming it, not a silent fallback.
    with pytest.raises(CheckpointError, match=rf"checkpoint.load_step=4: checkpoint {root / 'step-4'} is corrupt"):
        _manager(tmp_path, _build(seed=2), _Cfg(load_step=4)).load()
    # Rewinding to step 2 would save over step-4 as the run trains: refused until it is moved away.
    with pytest.raises(ResumeMismatchError, match=r"checkpoint.load_step=2 rewinds past the newer checkpoints "
                                                  r".*step-4, which this run would overwrite"):
        _manager(tmp_path, _build(seed=3), _Cfg(load_step=2)).load()
    shutil.move(root / "step-4", tmp_path / "step-4")
    assert _manager(tmp_path, _build(seed=3), _Cfg(load_step=2)).load() == 2


def test_missing_completion_marker_is_reported_not_skipped_silently(tmp_path, caplog):
    root = tmp_path / "checkpoint"
    parts = _build(seed=0)
    mgr = _manager(tmp_path, parts)
    mgr.save(1)
    mgr.save(2)
    (root / "step-2" / "manifest.json").unlink()
    assert list_checkpoints(str(root)) == [1]
    with caplog.at_level("WARNING", logger="torchtitan_glm.components.checkpoint"):
        assert _manager(tmp_path, _build(seed=1)).load() == 1
    assert any(f"{root / 'step-2'} (is incomplete: it has no manifest.json" in r.getMessage() for r in caplog.records)
    (root / "step-1" / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=rf"no checkpoint in {root} verifies: .*step-2.*step-1 \(is incomplete: "
                                              r"it has no \.metadata\)"):
        _manager(tmp_path, _build(seed=1)).load()


def test_a_non_finite_state_is_never_saved(tmp_path):
    from torchtitan_glm.components.errors import NonFiniteError

    root = tmp_path / "checkpoint"
    parts = _build(seed=0)
    mgr = _manager(tmp_path, parts, _Cfg(keep_latest_k=1))
    _train(*parts, 1)
    mgr.save(1)
    before = sorted(os.listdir(root))
    with torch.no_grad():
        parts[0][3].weight[0, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"not saving step 2: 3.weight hold"):
        mgr.save(2)
    with torch.no_grad():
        parts[0][3].weight[0, 1] = 0.0
        next(iter(parts[1].state.values()))["exp_avg_sq"][0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"not saving step 2: optimizer exp_avg_sq of 0.weight hold"):
        mgr.save(2)
    assert sorted(os.listdir(root)) == before == ["step-1"], "the good checkpoint must survive"


def test_a_rewind_never_overwrites_or_prunes_newer_checkpoints(tmp_path):
    """checkpoint.load_step before newer checkpoints is refused, naming them (the run would save over them); a
    save before newer checkpoints (e.g. after resuming from an older one because the newer are corrupt) prunes
    only what is older than itself."""
    root = str(tmp_path / "checkpoint")
    parts = _build(seed=0)
    mgr = _manager(tmp_path, parts, _Cfg(keep_latest_k=3))
    for s in (2, 4, 6):
        mgr.save(s)
    with pytest.raises(ResumeMismatchError, match=r"load_step=2 rewinds past the newer checkpoints .*step-4, "
                                                  r".*step-6, which .* move them out of"):
        _manager(tmp_path, _build(seed=1), _Cfg(keep_latest_k=1, load_step=2)).load()
    assert list_checkpoints(root) == [2, 4, 6]
    mgr2 = _manager(tmp_path, _build(seed=1), _Cfg(keep_latest_k=1))
    assert mgr2.save(3) and list_checkpoints(root) == [3, 4, 6]


class _FullDiskWriter(dcp.FileSystemWriter):
    """Writes the first files, then fails as a full disk does (ENOSPC), as FileSystemWriter would report it."""

    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_failed_save_is_one_line_and_leaves_no_partial_folder(tmp_path, monkeypatch, async_mode):
    parts = _build(0)
    ck = _manager(tmp_path, parts, _Cfg(interval=2, async_mode=async_mode))
    assert ck.save(2, force=True)  # a good checkpoint first
    monkeypatch.setattr(CheckpointManager, "_storage_writer", lambda self, path: _FullDiskWriter(path))
    with pytest.raises(CheckpointError) as info:
        ck.save(4)
        ck.close()  # an async save reports at the wait
    text = str(info.value)
    assert "\n" not in text and "No space left on device" in text and "step-4.tmp" in text, text
    assert f"the newest complete checkpoint is {step_dir(ck.root, 2)}" in text
    assert not os.path.exists(step_dir(ck.root, 4) + ".tmp") and list_checkpoints(ck.root) == [2]


def test_optimizer_groups_of_another_layout_are_laid_over_this_partition():
    """checkpoint.regroup: each current group keeps its own settings (this run's [optimizer]) and takes the LR
    settings of the saved groups that held its parameters (its own when none did), whatever the two partitions;
    saved groups whose LR settings disagree for one current group are an error."""
    from torchtitan_glm.components.checkpoint import regroup

    loaded = [{"params": ["a", "b"], "lr": 1.0, "initial_lr": 3.0, "weight_decay": 0.1, "betas": (0.9, 0.95)},
              {"params": ["c"], "lr": 1.0, "initial_lr": 3.0, "weight_decay": 0.0, "betas": (0.9, 0.95)},
              {"params": ["d"], "lr": 1.0, "initial_lr": 3.0, "weight_decay": 0.1, "betas": (0.9, 0.95)}]
    mine = {"lr": 2.0, "initial_lr": 2.0, "betas": (0.8, 0.9), "eps": 1e-6, "foreach": True}
    current = [{"params": ["a"], "weight_decay": 0.5, **mine}, {"params": ["b", "d"], "weight_decay": 0.5, **mine},
               {"params": ["c"], "weight_decay": 0.0, **mine}, {"params": ["e"], "weight_decay": 0.5, **mine}]
    lr_saved = {"lr": 1.0, "initial_lr": 3.0}
    assert regroup(loaded, current) == [
        {"params": ["a"], "weight_decay": 0.5, **mine, **lr_saved},
        {"params": ["b", "d"], "weight_decay": 0.5, **mine, **lr_saved},
        {"params": ["c"], "weight_decay": 0.0, **mine, **lr_saved},
        {"params": ["e"], "weight_decay": 0.5, **mine}]
    loaded[2]["lr"] = 0.5
    with pytest.raises(CheckpointError, match=r"disagree on \['lr'\]"):
        regroup(loaded, [{"params": ["a", "d"], **mine}])
    tensor_lr = [{"params": ["a"], "lr": torch.tensor(1.0)}, {"params": ["b"], "lr": torch.tensor(1.0)}]
    assert regroup(tensor_lr, [{"params": ["a", "b"], "lr": torch.tensor(3.0)}])[0]["lr"] == 1.0  # torchao's tensor lr
