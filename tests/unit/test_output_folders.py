"""The folders a run writes into are checked before anything is built: a file in the way, a folder that cannot be
written, named by the config key (train.py exits 2 before training, instead of failing at the first save)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_glm.components.outputs import check_output_folders
from torchtitan_glm.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]


def _cfg(dump, *extra):
    return load_config(["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(dump), *extra])


def test_writable_new_or_existing_folders_pass(tmp_path):
    check_output_folders(_cfg(tmp_path / "new" / "deeper"))
    check_output_folders(_cfg(tmp_path))
    assert not (tmp_path / "new").exists()  # checking creates nothing


@pytest.mark.parametrize("setup,key,words", [
    (lambda d: (d / "afile").write_text("x") and d / "afile", "job.dump_folder", "is not a directory"),
    (lambda d: (d / "afile").write_text("x") and d / "afile" / "sub", "job.dump_folder", "is a file"),
    (lambda d: (d / "run").mkdir() or (d / "run" / "checkpoint").write_text("x") and d / "run", "checkpoint.folder",
     "is not a directory"),
    (lambda d: (d / "run").mkdir() or (d / "run" / "tb").write_text("x") and d / "run", "metrics.save_tb_folder",
     "is not a directory"),
])
def test_a_file_in_the_way_is_named(tmp_path, setup, key, words):
    dump = setup(tmp_path)
    with pytest.raises(ConfigError) as info:
        check_output_folders(_cfg(dump, "--metrics.enable_tensorboard", "true"))
    assert info.value.key == key and words in str(info.value), info.value


def test_a_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    # access(2) answers for permissions and for a read-only file system (EROFS) alike; stand in for both
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == ro else real(path, mode))
    for dump, words in ((ro / "out", "cannot create"), (ro, "cannot write into")):
        with pytest.raises(ConfigError) as info:
            check_output_folders(_cfg(dump))
        assert info.value.key == "job.dump_folder" and words in str(info.value), info.value


def test_train_exits_2_before_training(tmp_path):
    (tmp_path / "checkpoint").write_text("not a folder")
    res = subprocess.run([sys.executable, "train.py", "--config", "train_configs/debug_model.toml",
                          f"--job.dump_folder={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "checkpoint.folder" in res.stderr and "step 1" not in res.stdout, res.stderr[-2000:]


def test_an_existing_final_export_stops_the_run_before_training(tmp_path):
    """A re-run whose final HF export folder is taken (e.g. a model-only last save, so no checkpoint finds the run
    complete) used to train from scratch and then fail at the export, its weights lost."""
    export_only = ["--training.steps", "7", "--checkpoint.last_save_in_hf", "true",
                   "--checkpoint.last_save_model_only", "true"]
    check_output_folders(_cfg(tmp_path, *export_only))
    export = tmp_path / "checkpoint" / "hf-step-7"
    export.mkdir(parents=True)
    check_output_folders(_cfg(tmp_path, *export_only))  # an empty folder is written into
    (export / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError) as info:
        check_output_folders(_cfg(tmp_path, *export_only))
    assert info.value.key == "checkpoint.last_save_in_hf" and str(export) in str(info.value)
    check_output_folders(_cfg(tmp_path, *export_only[:2]))  # no final export asked for
    check_output_folders(_cfg(tmp_path, "--training.steps", "9", *export_only[2:]))  # another step's export
    (tmp_path / "checkpoint" / "step-7").mkdir()
    check_output_folders(_cfg(tmp_path, *export_only))  # the run is complete: it writes nothing


def test_errors_found_after_loading_name_where_the_value_came_from(tmp_path, monkeypatch):
    """The layout and folder checks run after the config is loaded; their errors still say whether the key came
    from the command line, the config file or a default, as a loading error does."""
    from torchtitan_glm.train import check_layout

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as info:
        check_layout(_cfg(tmp_path, "--training.local_batch_size", "3", "--training.global_batch_size", "4"))
    assert info.value.source == ("command line --training.global_batch_size; config file "
                                 "train_configs/debug_model.toml"), info.value
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError) as info:
        check_output_folders(_cfg(tmp_path / "afile"))
    assert info.value.source.startswith("command line --job.dump_folder"), info.value


def test_main_checks_the_layout_once_and_hands_it_to_the_trainer(tmp_path, monkeypatch):
    """train.main runs check_layout and check_this_host before logging starts (exit 2) and gives the Trainer their
    result, so the checks (model args, layout, host memory) run once per start, not again inside the Trainer."""
    from torchtitan_glm import train

    calls = {"layout": 0, "host": 0}
    seen = {}
    real_layout, real_host = train.check_layout, train.check_this_host

    def count_layout(cfg):
        calls["layout"] += 1
        return real_layout(cfg)

    def count_host(cfg):
        calls["host"] += 1
        return real_host(cfg)

    class FakeTrainer:
        def __init__(self, cfg, *, argv=None, layout=None):
            seen["layout"] = layout

        def train(self):
            pass

        def close(self):
            pass

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(train, "check_layout", count_layout)
    monkeypatch.setattr(train, "check_this_host", count_host)
    monkeypatch.setattr(train, "Trainer", FakeTrainer)
    train.main(["--config", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path)])
    assert calls == {"layout": 1, "host": 1}
    dims, args = seen["layout"]
    assert dims.world_size == 1 and args.num_hidden_layers == real_layout(_cfg(tmp_path))[1].num_hidden_layers
