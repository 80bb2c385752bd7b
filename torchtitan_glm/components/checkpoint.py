"""Checkpoints with torch.distributed.checkpoint (DCP): save, verify, resume, keep the latest k, async saves, HF
import/export.

Layout under `{dump_folder}/{cfg.folder}/`:
  step-{N}/        a published checkpoint: DCP files + `.metadata`, `run.json` (what the run was: config, model
                   arguments; compared at resume) and `manifest.json` (size and SHA-256 of every other file)
  step-{N}.tmp/    a save in progress, or the leftover of a crashed one (ignored by load, removed by the next save)
  hf-step-{N}/     the HF export of the last step (cfg.last_save_in_hf; with cfg.last_save_model_only the last
                   step writes only this)

A save first checks that the state is finite (a non-finite state is never saved), writes `step-{N}.tmp/`, waits
until every rank has finished (DCP's final collective writes `.metadata` only after all ranks' data is on disk),
checksums the files (each rank those it wrote), then rank 0 writes the manifest, the completion marker, and renames
the folder to `step-{N}`: os.rename is atomic, so a crash at any moment leaves either the previous checkpoints
alone or the new one complete. keep_latest_k then prunes checkpoints older than the new one (never newer ones).

A load verifies the manifest first (the ranks share the files). Without an explicit step (cfg.load_step), a
corrupt or incomplete newest checkpoint is reported by name and the newest one that verifies is used.

One DCP state dict holds: "model" and "optimizer" (torch.distributed.checkpoint.state_dict getters/setters, so
FSDP2/TP/EP DTensor shards are saved once and resharded onto whatever layout loads them; plain replicated tensors,
such as the FP32-kept parameters, are deduplicated and read whole by every rank), "lr_scheduler", "train_state"
(the step) and "dataloader" (one global data position, the same on every rank; pickled), and per rank "rng_rank{r}"
(pickled RNG streams). A checkpoint loads under any layout: a rank gets its own RNG streams back when the world size
is unchanged (an exact resume), else rank 0's (training draws no random numbers; init happens before the load).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
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
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtitan_glm.components.errors import (CheckpointError, ExpectedError, NonFiniteError, ResumeMismatchError,
                                              one_line)
from torchtitan_glm.float8 import plain_tensors

__all__ = ["CheckpointManager", "list_checkpoints", "step_dir", "hf_export_dir", "list_hf_exports", "MANIFEST",
           "RUN_INFO"]

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
_HF_EXPORT_RE = re.compile(r"^hf-step-(\d+)$")
_TMP_RE = re.compile(r"^step-\d+(\.replaced)?\.tmp$")
_DCP_FILE_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # FileSystemWriter's per-rank data files
_METADATA = ".metadata"
MANIFEST = "manifest.json"  # written last: the completion marker
RUN_INFO = "run.json"
_HASH_CHUNK = 8 << 20
# DCP reports rank failures as CheckpointException, a BaseException (not an Exception).
_ERRORS = (Exception, dcp.CheckpointException)
_MODEL, _OPTIMIZER, _LR_SCHEDULER, _TRAIN_STATE = "model", "optimizer", "lr_scheduler", "train_state"
_DATALOADER = "dataloader"
_RNG_RE = re.compile(r"^rng_rank(\d+)\.")
_OPTIMIZER_GROUP_RE = re.compile(r"^optimizer\.param_groups\.(\d+)\.")


def _rng_key(rank: int) -> str:
    return f"rng_rank{rank}"


def step_dir(root: str, step: int) -> str:
    """The folder of the complete checkpoint of `step` under `root`."""
    return os.path.join(root, f"step-{step}")


def hf_export_dir(root: str, step: int) -> str:
    """The folder of the HF export of `step` under `root` (checkpoint.last_save_in_hf)."""
    return os.path.join(root, f"hf-step-{step}")


def list_hf_exports(root: str) -> list[int]:
    """Steps of the non-empty `hf-step-N` export folders in `root`, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root)
                  if (m := _HF_EXPORT_RE.match(name)) and os.path.isdir(os.path.join(root, name))
                  and os.listdir(os.path.join(root, name)))


def _step_folders(root: str) -> list[int]:
    """Steps of every `step-N` folder in `root`, complete or not, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root)
                  if (m := _STEP_RE.match(name)) and os.path.isdir(os.path.join(root, name)))


def list_checkpoints(root: str) -> list[int]:
    """Steps of the complete checkpoints in `root` (named step-N, holding DCP's .metadata and the manifest),
    ascending. Complete is not verified: load() checks the checksums."""
    return [s for s in _step_folders(root)
            if all(os.path.isfile(os.path.join(step_dir(root, s), f)) for f in (_METADATA, MANIFEST))]


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _owned(names: list[str], rank: int, world: int) -> list[str]:
    """The files `rank` checksums: the DCP data files it wrote (page-cache warm), the others round-robin."""
    out = []
    for i, name in enumerate(names):
        m = _DCP_FILE_RE.match(name)
        if (int(m.group(1)) if m else i) % world == rank:
            out.append(name)
    return out


def _file_problem(folder: str, name: str, entry: dict[str, Any]) -> str | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return f"{name} is missing"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return f"{name} has {size} bytes, the manifest says {entry['size']}"
    if _sha256(path) != entry["sha256"]:
        return f"{name} does not match its checksum"
    return None


class _ModelState(Stateful):
    """The model's (possibly DTensor-sharded) state dict through DCP's model getters/setters."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return plain_tensors(get_model_state_dict(self.model))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


class _OptimizerState(Stateful):
    """The optimizer state keyed by parameter FQN (so it reshards with the model).

    Which parameters share a param group follows the layout (optimizer.param_groups: plain and DTensor parameters
    apart), so a checkpoint of another layout can hold another partition, even another number of groups. DCP loads
    the groups index by index into the template, so the template holds as many groups as the checkpoint
    (`saved_groups`); this run's partition and settings then replace the loaded groups but for their LR (regroup):
    torch's set_optimizer_state_dict would pair groups by index, and leave a group no saved group maps to without
    its settings."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, saved_groups: int | None = None) -> None:
        self.model, self.optimizer, self.saved_groups = model, optimizer, saved_groups
        self._current: list[dict[str, Any]] | None = None

    def state_dict(self) -> dict[str, Any]:
        sd = plain_tensors(get_optimizer_state_dict(self.model, self.optimizer))
        # copies: DCP loads into the returned groups in place
        self._current = [dict(g, params=list(g["params"])) for g in sd["param_groups"]]
        if self.saved_groups is not None and self.saved_groups != len(sd["param_groups"]):
            template = sd["param_groups"][0]
            sd = dict(sd, param_groups=[dict(template) for _ in range(self.saved_groups)])  # values: loaded
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._current is None:
            self._current = get_optimizer_state_dict(self.model, self.optimizer)["param_groups"]
        state_dict = dict(state_dict, param_groups=regroup(state_dict["param_groups"], self._current))
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


def _same(a: Any, b: Any) -> bool:
    """Equal param-group settings, tensors (torchao's tensor lr) and tuples (betas) included."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# Param-group settings a resume takes from the checkpoint: the lr of the restored step (a scheduler that sets it
# when loaded, as the trainer's WarmupDecayLR does with this run's peak lr, overrides it). Every other setting
# (betas, eps, weight_decay, the implementation flags) is this run's [optimizer]: a changed one applies from the
# resume step on, and the trainer says so (resume.optimizer_note).
_SAVED_GROUP_KEYS = ("lr", "initial_lr")


def regroup(loaded: list[dict[str, Any]], current: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`current`'s partition of parameter FQNs and settings, each group with the LR settings (_SAVED_GROUP_KEYS) of
    the loaded groups that held its parameters (its own when none did). CheckpointError when those disagree."""
    owner = {fqn: g for g in loaded for fqn in g["params"]}
    out = []
    for cur in current:
        sources = list({id(owner[f]): owner[f] for f in cur["params"] if f in owner}.values()) or [cur]
        saved = [{k: g[k] for k in _SAVED_GROUP_KEYS if k in g} for g in sources]
        for other in saved[1:]:
            keys = [k for k in saved[0] if not _same(saved[0][k], other.get(k))]
            if keys:
                raise CheckpointError(f"the checkpoint's optimizer param groups disagree on {keys} for parameters "
                                      f"that now share one group (e.g. {cur['params'][0]})")
        out.append({**cur, **saved[0], "params": list(cur["params"])})
    return out


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
    initial_load_path, initial_load_in_hf, last_save_in_hf, load_step). Every rank must build it and call
    save/load/close at the same points (they are collective when a process group exists). hf_load_fn(model, path)
    and hf_save_fn(model, out_dir) import/export HF safetensors; they run on every rank. run_info (JSON-able) is
    saved with each checkpoint as run.json; read_run_info() gives it back.
    """

    def __init__(self, *, cfg: Any, dump_folder: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, dataloader: Any, extra_state: dict[str, Stateful] | None = None,
                 hf_load_fn: Callable[[nn.Module, str], None] | None = None,
                 hf_save_fn: Callable[[nn.Module, str], None] | None = None,
                 run_info: dict[str, Any] | None = None) -> None:
        if cfg.async_mode not in ("disabled", "async"):
            raise ValueError(f"checkpoint.async_mode must be 'disabled' or 'async', got {cfg.async_mode!r}")
        if cfg.initial_load_path and cfg.initial_load_in_hf and hf_load_fn is None:
            raise ValueError("checkpoint.initial_load_in_hf is set but no hf_load_fn was given")
        if cfg.last_save_in_hf and hf_save_fn is None:
            raise ValueError("checkpoint.last_save_in_hf is set but no hf_save_fn was given")
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.root = os.path.join(dump_folder, cfg.folder)
        self.hf_load_fn, self.hf_save_fn = hf_load_fn, hf_save_fn
        self.run_info = run_info
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
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
            _DATALOADER: _PickledState(dataloader),
            _rng_key(self.rank): _PickledState(_RNGState()),
            _TRAIN_STATE: self._train_state,
        }
        for key, obj in (extra_state or {}).items():
            if key in self.states:
                raise ValueError(f"extra_state key {key!r} collides with a built-in checkpoint key")
            self.states[key] = obj
        self._pending: tuple[Future, int, float, float] | None = None
        self._last_saved_step: int | None = None
        self._verified: dict[str, str | None] = {}  # folder -> its problem (None: it verified), this process

    # ------------------------------------------------------------------------------------------------ save
    def save(self, step: int, *, last: bool = False, force: bool = False) -> bool:
        """Checkpoint `step` if checkpointing is on and (step % interval == 0 or last or force); returns whether it
        saved. NonFiniteError (and nothing written) if a parameter or optimizer state is not finite.

        In async mode the write continues in the background and the checkpoint appears (is renamed) when the next
        save or close() waits for it; the last save (and a forced one) is synchronous. With last and
        cfg.last_save_in_hf, the model is also exported with hf_save_fn to `hf-step-{step}`; with
        cfg.last_save_model_only that export is all the last save writes.
        """
        if not self.cfg.enable or not (last or force or step % self.cfg.interval == 0):
            return False
        self._finish_pending()
        model_only = last and self.cfg.last_save_model_only  # validated: implies last_save_in_hf
        if step != self._last_saved_step:  # the last save may repeat the interval save of the same step
            self._check_finite(step)
            if not model_only:
                tmp = step_dir(self.root, step) + ".tmp"
                self._train_state.step = step
                start = time.perf_counter()
                try:
                    self._on_rank0(self._remove_stale_tmp)  # creates the folder: a read-only one fails here
                    if self.cfg.async_mode == "async" and not (last or force):
                        future = dcp.async_save(self.states, checkpoint_id=tmp,
                                                storage_writer=self._storage_writer(tmp), **self._dcp_kw)
                        self._pending = (future, step, start, time.perf_counter() - start)
                    else:
                        dcp.save(self.states, checkpoint_id=tmp, storage_writer=self._storage_writer(tmp),
                                 **self._dcp_kw)
                        self._commit(step, start, None)
                except CheckpointError:
                    raise
                except _ERRORS as e:
                    raise self._save_failed(step, e) from e
                self._last_saved_step = step
        if last and self.cfg.last_save_in_hf:
            self.export_hf(step)
        return True

    def export_hf(self, step: int) -> str:
        """The HF export of the model as it is, to `hf-step-{step}` (hf_save_fn); CheckpointError in one line naming
        the folder and the newest DCP checkpoint kept, if it fails. Collective."""
        out_dir = hf_export_dir(self.root, step)
        try:
            self.hf_save_fn(self.model, out_dir)
        except CheckpointError:
            raise
        except _ERRORS as e:
            kept = list_checkpoints(self.root)
            raise CheckpointError(f"the HF export of step {step} into {out_dir} failed: {_reason(e)}; "
                                  + (f"the newest checkpoint kept is {step_dir(self.root, kept[-1])}" if kept else
                                     "no checkpoint of this run is kept")) from e
        logger.info("exported HF checkpoint to %s", out_dir)
        return out_dir

    def _storage_writer(self, path: str) -> dcp.StorageWriter:
        """The DCP writer of a save into `path` (one file per rank, fsynced). A hook: tests slow it down."""
        return dcp.FileSystemWriter(path)

    def close(self) -> None:
        """Wait for a pending async save and publish it."""
        self._finish_pending()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        future, step, start, blocking = self._pending
        self._pending = None
        try:
            future.result()
            self._commit(step, start, blocking)
        except CheckpointError:
            raise
        except _ERRORS as e:
            raise self._save_failed(step, e, what="async checkpoint save") from e

    def _save_failed(self, step: int, error: BaseException, *, what: str = "checkpoint save") -> CheckpointError:
        """The one-line error of a failed save (full disk, unwritable folder, a rank's write error): rank 0 removes
        the partial step-N.tmp, so it does not hold the disk until the next save; earlier checkpoints stay."""
        tmp = step_dir(self.root, step) + ".tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = list_checkpoints(self.root) if os.path.isdir(self.root) else []  # step-N too if it was published
        newest = f"the newest complete checkpoint is {step_dir(self.root, kept[-1])}" if kept else \
            "no complete checkpoint exists yet"
        return CheckpointError(f"{what} of step {step} into {tmp} failed: {_reason(error)}; the partial folder was "
                               f"removed and {newest}")

    def _check_finite(self, step: int) -> None:
        """NonFiniteError naming the tensors (any rank's) whose values are not all finite; collective."""
        names: dict[torch.Tensor, str] = {}
        checks: list[tuple[str, torch.Tensor]] = []
        for name, p in self.model.named_parameters():
            names[p] = name
            checks.append((name, p))
        for p, state in self.optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    checks.append((f"optimizer {key} of {names.get(p, '?')}", value))
        bad = _non_finite([n for n, _ in checks], [t for _, t in checks])
        if self.distributed:
            gathered: list[list[str]] = [[] for _ in range(self.world)]
            dist.all_gather_object(gathered, bad, group=self._pg)
            bad = sorted({n for names_ in gathered for n in names_})
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise NonFiniteError(f"not saving step {step}: {', '.join(bad[:3])}{more} hold non-finite values "
                                 f"(the checkpoints in {self.root} are left as they are)")

    def _commit(self, step: int, start: float, blocking: float | None) -> None:
        """All ranks have written step-N.tmp (DCP's save/async future returns after its final collective): the
        ranks checksum the files, rank 0 writes run.json and the manifest, publishes the folder with an atomic
        rename, then prunes to keep_latest_k."""
        tmp = step_dir(self.root, step) + ".tmp"
        listing: list[Any] = [None]
        if self.rank == 0:
            if self.run_info is not None:
                _write_json(os.path.join(tmp, RUN_INFO), self.run_info)
            listing[0] = sorted(n for n in os.listdir(tmp) if n != MANIFEST) if os.path.isdir(tmp) else []
        if self.distributed:
            dist.broadcast_object_list(listing, src=0, group=self._pg)
        mine = {n: {"size": os.path.getsize(os.path.join(tmp, n)), "sha256": _sha256(os.path.join(tmp, n))}
                for n in _owned(listing[0], self.rank, self.world)}
        parts: list[Any] = [mine]
        if self.distributed:
            parts = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, parts, dst=0, group=self._pg)
        self._on_rank0(lambda: self._publish(step, {n: e for part in parts for n, e in part.items()}))
        self._verified.pop(step_dir(self.root, step), None)
        if self.rank == 0:
            size = sum(e["size"] for part in parts for e in part.values())
            took = time.perf_counter() - start
            timing = f"{took:.1f} s" if blocking is None else f"{blocking:.1f} s blocking, {took:.1f} s in all"
            logger.info("saved checkpoint step %d (%s, %s) to %s", step, _format_size(size), timing,
                        step_dir(self.root, step))

    def _publish(self, step: int, files: dict[str, dict[str, Any]]) -> None:
        tmp, final = step_dir(self.root, step) + ".tmp", step_dir(self.root, step)
        if _METADATA not in files:
            raise CheckpointError(f"checkpoint save wrote no {_METADATA} into {tmp}; not publishing it")
        _write_json(os.path.join(tmp, MANIFEST), {"step": step, "files": files})
        _fsync_dir(tmp)
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
        if keep > 0:  # only older checkpoints: newer ones (from a run resumed at an earlier step) stay
            for old_step in [s for s in list_checkpoints(self.root) if s <= step][:-keep]:
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
        """Restore the checkpoint of `step` (default: resume_step()) and return its step.

        With no checkpoint to resume, load cfg.initial_load_path if set (model weights only: HF via hf_load_fn
        when cfg.initial_load_in_hf, else a DCP folder) and return None: a fresh run.
        """
        self._finish_pending()
        if step is None:
            step = self.resume_step()
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

    def resume_step(self) -> int | None:
        """The step to resume from, verified: cfg.load_step if set (CheckpointError if it does not verify,
        ResumeMismatchError if newer checkpoints would be overwritten), else
        the newest checkpoint that verifies (newer corrupt or incomplete ones reported in one line), else None
        (none, or checkpointing off). CheckpointError if there are checkpoints but none verifies. Collective."""
        explicit = getattr(self.cfg, "load_step", -1)
        if explicit is not None and explicit > 0:
            problem = self._verify(step_dir(self.root, explicit))
            if problem:
                raise CheckpointError(f"checkpoint.load_step={explicit}: checkpoint {step_dir(self.root, explicit)} "
                                      f"{problem}", usage=True)  # the fix: another load_step
            newer = [step_dir(self.root, s) for s in self._shared(_step_folders(self.root)) if s > explicit]
            if newer:  # training on from an earlier step would save over them
                raise ResumeMismatchError(
                    f"checkpoint.load_step={explicit} rewinds past the newer checkpoints {', '.join(newer)}, which "
                    f"this run would overwrite as it trains: move them out of {self.root} to keep them and rewind, "
                    "or unset checkpoint.load_step to resume from the newest")
            return explicit
        if not self.cfg.enable:
            return None
        steps = self._shared(_step_folders(self.root))
        skipped: list[str] = []
        for step in reversed(steps):
            problem = self._verify(step_dir(self.root, step))
            if problem is None:
                if skipped and self.rank == 0:
                    logger.warning("skipping %s; resuming from step-%d, the newest checkpoint that verifies",
                                   "; ".join(skipped), step)
                return step
            skipped.append(f"checkpoint {step_dir(self.root, step)} ({problem})")
        if skipped:
            raise CheckpointError(f"no checkpoint in {self.root} verifies: {'; '.join(skipped)}; move them away "
                                  "to start from scratch, or use a new job.dump_folder")
        return None

    def read_run_info(self, step: int) -> dict[str, Any] | None:
        """The run.json saved with the checkpoint of `step` (None for a checkpoint without one)."""
        path = os.path.join(step_dir(self.root, step), RUN_INFO)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def _shared(self, value: Any) -> Any:
        """Rank 0's value of `value`, on every rank (so all ranks take the same decisions about the folder)."""
        box = [value]
        if self.distributed:
            dist.broadcast_object_list(box, src=0, group=self._pg)
        return box[0]

    def _verify(self, folder: str) -> str | None:
        """Why the checkpoint in `folder` cannot be trusted, or None: present, complete (.metadata and manifest),
        every file of the manifest with its size and SHA-256. The ranks share the reading. Collective; cached."""
        if folder in self._verified:
            return self._verified[folder]
        head: Any = None
        if self.rank == 0:
            head = _manifest_or_problem(folder)
        head = self._shared(head)
        if isinstance(head, str):
            problem: str | None = head
        else:
            files = head["files"]
            mine = [p for n in _owned(sorted(files), self.rank, self.world)
                    if (p := _file_problem(folder, n, files[n])) is not None]
            found = [mine]
            if self.distributed:
                found = [None] * self.world
                dist.all_gather_object(found, mine, group=self._pg)
            problems = sorted(p for part in found for p in part)
            problem = None if not problems else "is corrupt: " + "; ".join(problems[:3]) + (
                f" and {len(problems) - 3} more" if len(problems) > 3 else "")
        self._verified[folder] = problem
        return problem

    def _load_step(self, step: int) -> None:
        path = step_dir(self.root, step)
        problem = self._verify(path)
        if problem:
            raise CheckpointError(f"checkpoint {path} {problem}")
        states = self._states_to_load(path)
        try:
            dcp.load(states, checkpoint_id=path, **self._dcp_kw)
        except _ERRORS as e:
            inner = _expected_inside(e)
            if inner is not None:  # e.g. the data loader refusing this run's data: its own line and exit code
                raise inner from e
            raise CheckpointError(f"failed to load checkpoint {path}: {one_line(e)}") from e
        if self._train_state.step != step:
            raise CheckpointError(f"checkpoint {path} holds step {self._train_state.step}, not {step}")
        self._last_saved_step = step
        logger.info("loaded checkpoint %s", path)

    def _states_to_load(self, path: str) -> dict[str, Any]:
        """self.states with the RNG entry this rank reads: its own when the checkpoint was written by as many ranks
        as there are now, else rank 0's (the layout changed). CheckpointError for a pre-global-data checkpoint."""
        try:
            keys = list(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
        except _ERRORS as e:
            raise CheckpointError(f"cannot read the metadata of checkpoint {path}: {one_line(e)}") from e
        if not any(k.startswith(_DATALOADER + ".") for k in keys):
            raise CheckpointError(
                f"checkpoint {path} has no global data position (it keeps one per data-parallel rank: it was written "
                "by an older version, whose data order cannot be continued); resume it with that version, or start "
                "fresh with a new --job.dump_folder (checkpoint.initial_load_path can take its weights)")
        saved_world = len({m.group(1) for k in keys if (m := _RNG_RE.match(k))})
        states = dict(self.states)
        groups = {m.group(1) for k in keys if (m := _OPTIMIZER_GROUP_RE.match(k))}
        states[_OPTIMIZER] = _OptimizerState(self.model, self.optimizer, saved_groups=len(groups) or None)
        if saved_world != self.world:
            states[_rng_key(0)] = states.pop(_rng_key(self.rank))  # DCP loads by key
        return states

    def _load_model_only(self, path: str) -> None:
        """Model weights from a DCP folder: ours (keys under "model."; verified if it has a manifest) or a bare
        model state dict."""
        if not os.path.isfile(os.path.join(path, _METADATA)):
            hf = os.path.isfile(os.path.join(path, "config.json"))
            raise CheckpointError(f"checkpoint.initial_load_path {path} is not a DCP checkpoint (no {_METADATA})"
                                  + ("; it holds a config.json: for HF weights set checkpoint.initial_load_in_hf = "
                                     "true" if hf else ""), usage=True)
        if os.path.isfile(os.path.join(path, MANIFEST)):
            problem = self._verify(path)
            if problem:
                raise CheckpointError(f"checkpoint.initial_load_path {path} {problem}")
        try:
            meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            keys = meta.keys()
            ours = any(k.startswith(_MODEL + ".") for k in keys)
            misfit = _model_misfit(self.model, meta, prefix=_MODEL + "." if ours else "")
            if misfit:
                raise CheckpointError(f"checkpoint.initial_load_path {path} does not fit this model: {misfit}; its "
                                      f"run's model arguments ({RUN_INFO} beside it) differ from this run's",
                                      usage=True)
            if ours:
                dcp.load({_MODEL: _ModelState(self.model)}, checkpoint_id=path, **self._dcp_kw)
            else:
                sd = get_model_state_dict(self.model)
                dcp.load(sd, checkpoint_id=path, **self._dcp_kw)
                set_model_state_dict(self.model, sd)
        except CheckpointError:
            raise
        except _ERRORS as e:
            raise CheckpointError(f"failed to load model weights from {path}: {one_line(e)}") from e


def _expected_inside(e: BaseException) -> ExpectedError | None:
    """The project's own error that a state's load_state_dict raised inside DCP (DCP re-raises it wrapped, one per
    failed rank, as a CheckpointException whose message carries the tracebacks), if that is what failed."""
    if isinstance(e, ExpectedError):
        return e
    failures = getattr(e, "failures", None) or {}
    for failure in failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, ExpectedError):
            return inner
    return None


def _model_misfit(model: nn.Module, meta: dict[str, Any], *, prefix: str) -> str | None:
    """What keeps a saved model state dict (DCP metadata, keys under `prefix`) from loading into `model`: the
    parameters and buffers it lacks, those this model lacks, and shapes that differ (None: it fits)."""
    want = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    have = {k[len(prefix):]: tuple(v.size) for k, v in meta.items()
            if k.startswith(prefix) and hasattr(v, "size")}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    shapes = sorted(k for k in set(want) & set(have) if want[k] != have[k])
    parts = []
    if missing:
        parts.append(f"it lacks {len(missing)} of this model's tensors (e.g. {', '.join(missing[:3])})")
    if extra:
        parts.append(f"it holds {len(extra)} tensors this model does not have (e.g. {', '.join(extra[:3])})")
    if shapes:
        parts.append(f"{len(shapes)} tensors differ in shape (e.g. {shapes[0]}: saved {list(have[shapes[0]])}, "
                     f"this model {list(want[shapes[0]])})")
    return "; ".join(parts) or None


def _manifest_or_problem(folder: str) -> dict[str, Any] | str:
    """The manifest of a checkpoint folder, or why there is none to verify against."""
    if not os.path.isdir(folder):
        root = os.path.dirname(folder)
        return f"does not exist (complete checkpoints in {root}: {list_checkpoints(root)})"
    if not os.path.isfile(os.path.join(folder, _METADATA)):
        return f"is incomplete: it has no {_METADATA}"
    if not os.path.isfile(os.path.join(folder, MANIFEST)):
        return f"is incomplete: it has no {MANIFEST} (the completion marker)"
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        if not isinstance(files, dict) or not all({"size", "sha256"} <= set(e) for e in files.values()):
            raise ValueError("malformed")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"is corrupt: unreadable {MANIFEST} ({e})"
    return manifest


def _non_finite(names: list[str], tensors: list[torch.Tensor]) -> list[str]:
    """Names of the tensors (local shards of DTensors) holding a NaN or an infinity; one device sync."""
    flags, kept = [], []
    for name, t in zip(names, tensors):
        local = t.to_local() if hasattr(t, "to_local") else t
        if type(local) is not torch.Tensor and hasattr(local, "_tensor"):  # torchao's FP8 all-gather wrapper
            local = local._tensor
        if is_traceable_wrapper_subclass(local) and hasattr(local, "dequantize"):  # torchao's low-bit optim states
            local = local.dequantize()
        if local.numel() == 0 or not (local.is_floating_point() or local.is_complex()):
            continue
        lo, hi = torch.aminmax(local.detach())
        flags.append(torch.isfinite(lo) & torch.isfinite(hi))
        kept.append(name)
    if not flags:
        return []
    ok = torch.stack([f.to(flags[0].device) for f in flags]).cpu().tolist()
    return [n for n, good in zip(kept, ok) if not good]


def _reason(error: BaseException) -> str:
    """The root cause of a save error in one line: DCP's CheckpointException carries each failed rank's
    exception (and a traceback) in `failures`."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        rank, (exc, _) = min(error.failures.items())
        return f"rank {rank}: {_reason(exc)}"
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror} ({error.filename})" if error.filename else error.strerror
    return f"{type(error).__name__}: {error}"


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def _format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


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
