"""StepProfiler: torch.profiler over a window of training steps ([profiling]), to find where a step's time goes.

The window is given in training steps (start_step .. start_step + steps - 1), not in profiler schedule ticks, so a
resumed run profiles the same steps. The window starts and ends with a device synchronisation: its wall time is the
profiled steps' own; a log step inside the window includes the profiler's overhead, and the trainer restarts its
throughput window after it. Output under
job.dump_folder/trace_folder: one Chrome trace per rank (rank<r>_steps<a>-<b>.json.gz, for chrome://tracing or
Perfetto) and, on rank 0, ops.txt, the table of operators and kernels sorted by their own device time (host time
on CPU), headed by the window's wall time and device busy time per step (device_busy_us). A host-bound step
shows as busy time well below wall time. With `memory` the window also records CUDA allocations (torch's memory
history, Python stacks): each rank's snapshot memory_rank<r>_steps<a>-<b>.pickle (pytorch.org/memory_viz) and rank
0's memory.txt, what was alive at the window's allocated peak by allocating source line (components/memory_peak.py).
An out-of-memory inside the window (or an error caused by one) writes them too, on the rank that ran out:
memory_rank<r>_oom.pickle and memory_rank<r>_oom.txt, the failed request counted in the peak (that is when the
breakdown is wanted most). Nothing is overwritten: a run that profiles into a folder already holding these files (a
re-run, a resume) writes all of its window's files with one suffix, rank<r>_steps<a>-<b>.run<n>.json.gz,
ops.run<n>.txt and so on, n = 2, 3, ...
"""

from __future__ import annotations

import os
import pickle
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from torchtitan_glm.components.memory_peak import breakdown, start_recording, stop_recording
from torchtitan_glm.config import ProfilingConfig

__all__ = ["StepProfiler", "device_busy_us"]


def device_busy_us(events) -> float:
    """Microseconds in which at least one kernel, copy or memset ran on a device: the union of their intervals
    (streams overlap). The GPU-side ranges of user annotations (FSDP's, the optimizer's step) are not work and are
    left out: counted, they took the first proxy profile to 125% of its wall time."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    busy, start, end = 0.0, None, None
    for s, e in spans:
        if end is None or s > end:
            busy += 0.0 if end is None else end - start
            start, end = s, e
        else:
            end = max(end, e)
    return busy + (0.0 if end is None else end - start)


class StepProfiler:
    """Call `begin(step)` before and `end(step)` after each training step; use as a context manager so that an
    error inside the window stops the profiler (nothing is written then)."""

    def __init__(self, *, cfg: ProfilingConfig, dump_folder: str, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.folder = os.path.join(dump_folder, cfg.trace_folder)
        self._prof: profile | None = None
        self._recording = False  # CUDA memory history on (cfg.memory, inside the window)
        self._before = 0  # bytes allocated when the recording began (not in its trace)
        self._suffix = ""  # the window's run suffix ('', '.run2', ...), chosen when it begins
        self._t0 = 0.0
        self.summary: str | None = None  # the header line of the last window written
        self.memory_summary: str | None = None  # the same for the last memory table written

    def missed(self, first_step: int) -> str | None:
        """A warning when a run that starts (or resumes) at first_step cannot reach the whole window, else None."""
        if (self.cfg.enable or self.cfg.memory) and first_step > self.first:
            return (f"profiling: the run starts at step {first_step}, after profiling.start_step={self.first}: "
                    f"nothing is profiled")
        return None

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
        if self._recording:
            if _out_of_memory(exc):
                self._write_memory("oom")
            else:
                self._stop_recording()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self, step: int) -> None:
        if step != self.first or not (self.cfg.enable or self.cfg.memory):
            return
        self._suffix = self._free_suffix()
        self._sync()
        if self.cfg.memory:  # CUDA only: train.py's check_layout refuses it elsewhere, naming the key
            self._before = torch.cuda.memory_allocated(self.device)
            start_recording()
            self._recording = True
        if self.cfg.enable:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        self._t0 = time.perf_counter()

    def _names(self) -> list[str]:
        """Every file this rank may write for the window (without the run suffix)."""
        window = f"steps{self.first}-{self.last}"
        names = [f"rank{self.rank}_{window}.json.gz", f"memory_rank{self.rank}_{window}.pickle",
                 f"memory_rank{self.rank}_oom.pickle", f"memory_rank{self.rank}_oom.txt"]
        return names + (["ops.txt", "memory.txt"] if self.rank == 0 else [])

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, self._suffix.join(_split_ext(name)))

    def _free_suffix(self) -> str:
        """The first suffix ('', '.run2', ...) before the extension under which none of the window's files exists
        yet: an earlier run's files in the folder are kept, and one window's files share their suffix."""
        for n in range(1, 10_000):
            sfx = "" if n == 1 else f".run{n}"
            if not any(os.path.exists(os.path.join(self.folder, sfx.join(_split_ext(name))))
                       for name in self._names()):
                return sfx
        raise FileExistsError(f"{self.folder} holds 10,000 profiles of steps {self.first}-{self.last}")

    def _stop_recording(self) -> None:
        stop_recording()
        self._recording = False

    def _write_memory(self, tag: str) -> None:
        """The recorded snapshot to this rank's pickle, and on rank 0 the live-at-peak table; recording stops."""
        snapshot = torch.cuda.memory._snapshot()
        self._stop_recording()
        os.makedirs(self.folder, exist_ok=True)
        with open(self._path(f"memory_rank{self.rank}_{tag}.pickle"), "wb") as f:
            pickle.dump(snapshot, f)
        # the window's table is rank 0's; an out-of-memory's is the failing rank's own (rank 0 may be waiting in
        # a collective and never get here)
        table = self._path(f"memory_rank{self.rank}_oom.txt" if tag == "oom" else "memory.txt")
        if tag != "oom" and self.rank != 0:
            return
        gib = 2**30
        window = f"an out-of-memory on rank {self.rank}" if tag == "oom" else f"steps {self.first}-{self.last}"
        self.memory_summary = (
            f"memory: {window}; allocated before the window (not in the table) {self._before / gib:.2f} GiB; "
            f"the run's peaks so far: allocated {torch.cuda.max_memory_allocated(self.device) / gib:.2f} GiB, "
            f"reserved {torch.cuda.max_memory_reserved(self.device) / gib:.2f} GiB; snapshots and "
            f"{os.path.basename(table)} in {self.folder}")
        with open(table, "w") as f:
            f.write(self.memory_summary + "\n\n" + breakdown(snapshot, title=window) + "\n")
        print(self.memory_summary, flush=True)

    def end(self, step: int) -> bool:
        """Close the window after its last step: True when it did (the caller restarts its throughput window)."""
        if step != self.last or (self._prof is None and not self._recording):
            return False
        self._sync()
        wall_ms = (time.perf_counter() - self._t0) * 1e3 / self.cfg.steps
        prof, self._prof = self._prof, None
        if prof is not None:  # stopped first: writing the memory snapshot is not part of the profile
            prof.__exit__(None, None, None)
        if self._recording:
            self._write_memory(f"steps{self.first}-{self.last}")
        if prof is None:
            return True
        os.makedirs(self.folder, exist_ok=True)
        trace, ops = self._path(f"rank{self.rank}_steps{self.first}-{self.last}.json.gz"), self._path("ops.txt")
        prof.export_chrome_trace(trace)
        if self.rank != 0:
            return True
        on_device = self.device.type == "cuda"
        busy_ms = device_busy_us(prof.events()) / 1e3 / self.cfg.steps
        self.summary = (f"profile: steps {self.first}-{self.last}, wall {wall_ms:.1f} ms/step"
                        + (f", device busy {busy_ms:.1f} ms/step ({100 * busy_ms / wall_ms:.0f}% of wall)"
                           if on_device else "") + f"; traces and {os.path.basename(ops)} in {self.folder}")
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total" if on_device else "self_cpu_time_total", row_limit=self.cfg.row_limit)
        with open(ops, "w") as f:
            f.write(self.summary + "\n\n" + table + "\n")
        print(self.summary, flush=True)
        return True


def _split_ext(name: str) -> tuple[str, str]:
    """('rank0_steps1-2', '.json.gz') for 'rank0_steps1-2.json.gz': the run suffix goes between."""
    stem, dot, ext = name.partition(".")
    return stem, dot + ext


def _out_of_memory(exc: BaseException | None) -> bool:
    """exc is a CUDA out-of-memory, or was raised from one (a compile or autograd error wrapping it)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
