"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume, keep the latest k, async saves, HF import/export.

Layout under `{dump_folder}/{cfg.folder}/`:
  step-{N}/        a complete checkpoint (DCP files + `.metadata`); only folders with this exact name count
  step-{N}.tmp/    a save in progress, or the leftover of a crashed one (ignored by load, removed by the next save)
  hf-step-{N}/     the HF export of the last step (cfg.last_save_in_hf)

A save writes `step-{N}.tmp/`, waits until every rank has finished (DCP's final collective writes `.metadata`
only after all ranks' data is on disk), then rank 0 renames it to `step-{N}`: os.rename is atomic, so a crash at any
moment leaves either the previous checkpoints alone or the new one complete.

One DCP state dict holds: "model" and "optimizer" (torch.distributed.checkpoint.state_dict getters/setters, so FSDP2
DTensor shards are saved and resharded), "lr_scheduler", "train_state" (the step), and per-rank
"dataloader_rank{r}" and "rng_rank{r}" (pickled, so each rank gets its own position and RNG streams back).
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchtitan_glm.float8 import plain_tensors

__all__ = ["CheckpointManager", "list_checkpoints", "step_dir"]

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-\d+(\.replaced)?\.tmp$")
_METADATA = ".metadata"
# DCP reports rank failures as CheckpointException, a BaseException (not an Exception).
_ERRORS = (Exception, dcp.CheckpointException)
_MODEL, _OPTIMIZER, _LR_SCHEDULER, _TRAIN_STATE = "model", "optimizer", "lr_scheduler", "train_state"


def step_dir(root: str, step: int) -> str:
    """The folder of the complete checkpoint of `step` under `root`."""
    return os.path.join(root, f"step-{step}")


def list_checkpoints(root: str) -> list[int]:
    """Steps of the complete checkpoints in `root` (named step-N and holding DCP's .metadata), ascending."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(root, name, _METADATA)):
            steps.append(int(m.group(1)))
    return sorted(steps)


class _ModelState(Stateful):
    """The model's (possibly DTensor-sharded) state dict through DCP's model getters/setters."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return plain_tensors(get_model_state_dict(self.model))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class _OptimizerState(Stateful):
    """The optimizer state keyed by parameter FQN (so it reshards with the model)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return plain_tensors(get_optimizer_state_dict(self.model, self.optimizer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class _PickledState(Stateful):
    """Any state_dict()/load_state_dict() object stored as one pickled blob, so the structure of a freshly built
    object need not match the saved one (DCP otherwise loads only the keys the fresh object already has)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"pickle": pickle.dumps(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(pickle.loads(state_dict["pickle"]))


class _RNGState:
    """This process's RNG streams: torch CPU, the current CUDA device (if any), python `random`, numpy."""

    def state_dict(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])


class _TrainState(Stateful):
    """The number of completed optimizer steps at the save."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


class CheckpointManager:
    """Saves and restores a run's full state with DCP; see the module docstring for the layout and guarantees.

    cfg is the [checkpoint] section (duck-typed: enable, folder, interval, keep_latest_k, async_mode,
    initial_load_path, initial_load_in_hf, last_save_in_hf). Every rank must build it and call save/load/close at
    the same points (they are collective when a process group exists). hf_load_fn(model, path) and
    hf_save_fn(model, out_dir) import/export HF safetensors; they run on every rank.
    """

    def __init__(self, *, cfg: Any, dump_folder: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, dataloader: Any, extra_state: dict[str, Stateful] | None = None,
                 hf_load_fn: Callable[[nn.Module, str], None] | None = None,
                 hf_save_fn: Callable[[nn.Module, str], None] | None = None) -> None:
        if cfg.async_mode not in ("disabled", "async"):
            raise ValueError(f"checkpoint.async_mode must be 'disabled' or 'async', got {cfg.async_mode!r}")
        if cfg.initial_load_path and cfg.initial_load_in_hf and hf_load_fn is None:
            raise ValueError("checkpoint.initial_load_in_hf is set but no hf_load_fn was given")
        if cfg.last_save_in_hf and hf_save_fn is None:
            raise ValueError("checkpoint.last_save_in_hf is set but no hf_save_fn was given")
        self.cfg, self.model = cfg, model
        self.root = os.path.join(dump_folder, cfg.folder)
        self.hf_load_fn, self.hf_save_fn = hf_load_fn, hf_save_fn
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        # A private gloo group: CPU collectives for async saves (required when the default group is NCCL) and for
        # the manager's barriers; separate from the default group so a background save never interleaves its
        # collectives with training's (FSDP on gloo uses the default group from the main thread).
        self._pg = dist.new_group(backend="gloo") if self.distributed else None
        self._dcp_kw = {"process_group": self._pg, "no_dist": not self.distributed}
        self._train_state = _TrainState()
        self.states: dict[str, Any] = {
            _MODEL: _ModelState(model),
            _OPTIMIZER: _OptimizerState(model, optimizer),
            _LR_SCHEDULER: _PickledState(lr_scheduler),
            f"dataloader_rank{self.rank}": _PickledState(dataloader),
            f"rng_rank{self.rank}": _PickledState(_RNGState()),
            _TRAIN_STATE: self._train_state,
        }
        for key, obj in (extra_state or {}).items():
            if key in self.states:
                raise ValueError(f"extra_state key {key!r} collides with a built-in checkpoint key")
            self.states[key] = obj
        self._pending: tuple[Future, int] | None = None
        self._last_saved_step: int | None = None

    # ------------------------------------------------------------------------------------------------ save
    def save(self, step: int, *, last: bool = False) -> bool:
        """Checkpoint `step` if checkpointing is on and (step % interval == 0 or last); returns whether it saved.

        In async mode the write continues in the background and the checkpoint appears (is renamed) when the next
        save or close() waits for it; the last save is always synchronous. With last and cfg.last_save_in_hf, the
        model is also exported with hf_save_fn to `hf-step-{step}`.
        """
        if not self.cfg.enable or not (last or step % self.cfg.interval == 0):
            return False
        self._finish_pending()
        if step != self._last_saved_step:  # the last save may repeat the interval save of the same step
            tmp = step_dir(self.root, step) + ".tmp"
            self._on_rank0(self._remove_stale_tmp)
            self._train_state.step = step
            if self.cfg.async_mode == "async" and not last:
                future = dcp.async_save(self.states, checkpoint_id=tmp, storage_writer=self._storage_writer(tmp),
                                        **self._dcp_kw)
                self._pending = (future, step)
            else:
                dcp.save(self.states, checkpoint_id=tmp, storage_writer=self._storage_writer(tmp), **self._dcp_kw)
                self._commit(step)
            self._last_saved_step = step
        if last and self.cfg.last_save_in_hf:
            out_dir = os.path.join(self.root, f"hf-step-{step}")
            self.hf_save_fn(self.model, out_dir)
            logger.info("exported HF checkpoint to %s", out_dir)
        return True

    def _storage_writer(self, path: str) -> dcp.StorageWriter:
        """The DCP writer of a save into `path` (one file per rank, fsynced). A hook: tests slow it down."""
        return dcp.FileSystemWriter(path)

    def close(self) -> None:
        """Wait for a pending async save and publish it."""
        self._finish_pending()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        future, step = self._pending
        self._pending = None
        try:
            future.result()
        except _ERRORS as e:
            raise RuntimeError(f"async checkpoint save of step {step} into {step_dir(self.root, step)}.tmp "
                               f"failed: {e}") from e
        self._commit(step)

    def _commit(self, step: int) -> None:
        """All ranks have written step-N.tmp (DCP's save/async future returns after its final collective): rank 0
        publishes it with an atomic rename, then prunes to keep_latest_k."""
        self._on_rank0(lambda: self._publish(step))
        logger.info("saved checkpoint %s", step_dir(self.root, step))

    def _publish(self, step: int) -> None:
        tmp, final = step_dir(self.root, step) + ".tmp", step_dir(self.root, step)
        if not os.path.isfile(os.path.join(tmp, _METADATA)):
            raise RuntimeError(f"checkpoint save wrote no {_METADATA} into {tmp}; not publishing it")
        if os.path.exists(final):  # re-saving a step (e.g. a rerun): move the old one aside, then swap
            old = final + ".replaced.tmp"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)
        keep = self.cfg.keep_latest_k
        if keep > 0:
            for old_step in list_checkpoints(self.root)[:-keep]:
                shutil.rmtree(step_dir(self.root, old_step), ignore_errors=True)

    def _remove_stale_tmp(self) -> None:
        """Leftovers of crashed saves (no save is in flight here: pending ones were waited for)."""
        os.makedirs(self.root, exist_ok=True)
        for name in os.listdir(self.root):
            if _TMP_RE.match(name):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _on_rank0(self, fn: Callable[[], None]) -> None:
        """Run fn on rank 0, then barrier; rank 0 re-raises fn's error after the barrier (so no rank hangs)."""
        error: BaseException | None = None
        if self.rank == 0:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                error = e
        if self.distributed:
            dist.barrier(group=self._pg)
        if error is not None:
            raise error

    # ------------------------------------------------------------------------------------------------ load
    def load(self, step: int | None = None) -> int | None:
        """Restore the checkpoint of `step` (default: the latest complete one) and return its step.

        With no checkpoint (or checkpointing off and no step asked for), load cfg.initial_load_path if set (model
        weights only: HF via hf_load_fn when cfg.initial_load_in_hf, else a DCP folder) and return None: a fresh run.
        """
        self._finish_pending()
        if step is None and self.cfg.enable:
            step = self._latest_step()
        if step is not None:
            self._load_step(step)
            return step
        path = self.cfg.initial_load_path
        if path:
            if self.cfg.initial_load_in_hf:
                self.hf_load_fn(self.model, path)
            else:
                self._load_model_only(path)
            logger.info("loaded initial weights from %s", path)
        return None

    def _latest_step(self) -> int | None:
        """Rank 0's view of the newest complete checkpoint, shared so every rank loads the same one."""
        steps = list_checkpoints(self.root)
        found = [steps[-1] if steps else None]
        if self.distributed:
            dist.broadcast_object_list(found, src=0, group=self._pg)
        return found[0]

    def _load_step(self, step: int) -> None:
        path = step_dir(self.root, step)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint of step {step} not found: {path} does not exist "
                                    f"(complete checkpoints in {self.root}: {list_checkpoints(self.root)})")
        if not os.path.isfile(os.path.join(path, _METADATA)):
            raise RuntimeError(f"checkpoint {path} is incomplete or corrupt: it has no {_METADATA}")
        try:
            dcp.load(self.states, checkpoint_id=path, **self._dcp_kw)
        except _ERRORS as e:
            raise RuntimeError(f"failed to load checkpoint {path}: {e}") from e
        if self._train_state.step != step:
            raise RuntimeError(f"checkpoint {path} holds step {self._train_state.step}, not {step}")
        self._last_saved_step = step
        logger.info("loaded checkpoint %s", path)

    def _load_model_only(self, path: str) -> None:
        """Model weights from a DCP folder: ours (keys under "model.") or a bare model state dict."""
        if not os.path.isfile(os.path.join(path, _METADATA)):
            raise FileNotFoundError(f"checkpoint.initial_load_path {path} is not a DCP checkpoint (no {_METADATA})")
        try:
            keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys()
            if any(k.startswith(_MODEL + ".") for k in keys):
                dcp.load({_MODEL: _ModelState(self.model)}, checkpoint_id=path, **self._dcp_kw)
            else:
                sd = get_model_state_dict(self.model)
                dcp.load(sd, checkpoint_id=path, **self._dcp_kw)
                set_model_state_dict(self.model, sd)
        except _ERRORS as e:
            raise RuntimeError(f"failed to load model weights from {path}: {e}") from e


def _fsync_dir(path: str) -> None:
    """Make a rename in `path` durable (best effort: not every filesystem supports fsync on a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
