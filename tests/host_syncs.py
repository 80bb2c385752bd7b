"""Counting host syncs on CPU, where no call blocks: every read of a tensor's value on the host (.item(), float(),
bool(), .tolist(), .cpu(), .numpy()), every device-to-host copy and every op whose output shape depends on values
(nonzero, masked_select, boolean indexing: they read a count on the host) is recorded with the innermost frame of
the project that made it. Host copies made by StepStats.finish are exempt (pinned host memory on a GPU run), and so
is any tensor the caller lists (e.g. optimizer step counters, which stay on the host)."""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan_glm.components.step_stats import is_host_copy

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__}
_PROJECT = os.sep + "torchtitan_glm" + os.sep


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if _PROJECT in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.split(_PROJECT, 1)[1]}:{f.lineno}"


def _bool_index(func, args) -> bool:
    return func is torch.ops.aten.index.Tensor and any(
        i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])


@dataclass
class Sync:
    what: str
    where: str
    step: int | None


@dataclass
class SyncRecorder:
    """`with SyncRecorder(step=lambda: trainer.step) as rec:` ... `rec.syncs`."""

    step: Callable[[], int | None] = lambda: None
    exempt: Callable[[torch.Tensor], bool] = lambda t: False
    syncs: list[Sync] = field(default_factory=list)
    reading: int = 0

    def _skip(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and (is_host_copy(t) or self.exempt(t))

    def add(self, what: str) -> None:
        self.syncs.append(Sync(what, _where(), self.step()))

    def __enter__(self) -> "SyncRecorder":
        rec = self

        class _Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func not in _READS:
                    return func(*args, **(kwargs or {}))
                if not (args and rec._skip(args[0])):
                    rec.add(f"Tensor.{func.__name__}")
                rec.reading += 1  # its _local_scalar_dense is this read, not another one
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    rec.reading -= 1

        class _Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                tags = func.tags
                if func is torch.ops.aten._local_scalar_dense.default:
                    if not rec.reading and not rec._skip(args[0]):
                        rec.add(str(func))
                elif torch.Tag.data_dependent_output in tags or _bool_index(func, args) or (
                        torch.Tag.dynamic_output_shape in tags and func is not torch.ops.aten.index.Tensor):
                    rec.add(str(func))
                elif func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                    src = args[1] if func is torch.ops.aten.copy_.default else args[0]
                    dst = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
                    if dst is not None and torch.device(dst).type == "cpu" and src.device.type != "cpu":
                        rec.add(f"{func} device to host")
                return func(*args, **kwargs)

        self._modes = [_Functions(), _Dispatch()]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
