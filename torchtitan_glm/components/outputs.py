"""The folders a run writes into, checked before anything is built: a dump folder that is a file, a read-only
file system or a file where the checkpoint folder goes would otherwise surface at the first save, after a whole
checkpoint interval of training is lost."""

from __future__ import annotations

import os
from typing import Any

from torchtitan_glm.config import ConfigError

__all__ = ["check_output_folders"]


def _folder_problem(path: str) -> str | None:
    """Why `path` cannot become a folder this process writes into (None: it can), without creating anything."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"{path} exists and is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"cannot write into {path} (no permission, or a read-only file system)"
        return None
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot create {path}: {parent} is a file"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path} inside {parent} (no permission, or a read-only file system)"
    return None


def check_output_folders(cfg: Any) -> None:
    """ConfigError naming the key whose folder (job.dump_folder, and under it the checkpoint, TensorBoard and
    profiler folders the config turns on) cannot be created or written, or whose final HF export already exists."""
    root = cfg.job.dump_folder
    folders = [("job.dump_folder", root)]
    if cfg.checkpoint.enable:
        folders.append(("checkpoint.folder", os.path.join(root, cfg.checkpoint.folder)))
    if cfg.metrics.enable_tensorboard:
        folders.append(("metrics.save_tb_folder", os.path.join(root, cfg.metrics.save_tb_folder)))
    if cfg.profiling.enable:
        folders.append(("profiling.trace_folder", os.path.join(root, cfg.profiling.trace_folder)))
    try:
        for key, path in folders:
            problem = _folder_problem(path)
            if problem:
                raise ConfigError(key, problem)
        _check_final_export(cfg)
    except ConfigError as e:
        raise cfg.with_source(e) from None


def _check_final_export(cfg: Any) -> None:
    """ConfigError naming checkpoint.last_save_in_hf when the run's final HF export folder already holds files
    and the run would train to it (no checkpoint of that step to find it complete): the export refuses to
    overwrite them, so the run would fail after training, its weights lost with a model-only last save."""
    ck = cfg.checkpoint
    if not (ck.enable and ck.last_save_in_hf):
        return
    from torchtitan_glm.components.checkpoint import hf_export_dir, list_hf_exports, step_dir

    root = os.path.join(cfg.job.dump_folder, ck.folder)
    steps = cfg.training.steps
    export = hf_export_dir(root, steps)
    if steps in list_hf_exports(root) and not os.path.isdir(step_dir(root, steps)):
        raise ConfigError("checkpoint.last_save_in_hf",
                          f"{export} already holds an HF export, and this run would write its final export of step "
                          f"{steps} there after training: move it away, or use a new --job.dump_folder")
