"""StepProfiler: torch.profiler over a window of training steps ([profiling]), to find where a step's time goes.

The window is given in training steps (start_step .. start_step + steps - 1), not in profiler schedule ticks, so a
resumed run profiles the same steps. The window starts and ends with a device synchronisation: its wall time is the
profiled steps' own; a log step inside the window includes the profiler's overhead, and the trainer restarts its
throughput window after it. Output under
job.dump_folder/trace_folder: one Chrome trace per rank (rank<r>_steps<a>-<b>.json.gz, for chrome://tracing or
Perfetto) and, on rank 0, ops.txt, the table of operators and kernels sorted by their own device time (host time
on CPU), headed by the window's wall time and device busy time per step (device_busy_us). A host-bound step
shows as busy time well below wall time. Nothing is overwritten: a run that profiles into a folder already holding
these files (a re-run, a resume) writes rank<r>_steps<a>-<b>.run<n>.json.gz and ops.run<n>.txt, n = 2, 3, ...
"""

from __future__ import annotations

import os
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

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
        self._t0 = 0.0
        self.summary: str | None = None  # the header line of the last window written

    def missed(self, first_step: int) -> str | None:
        """A warning when a run that starts (or resumes) at first_step cannot reach the whole window, else None."""
        if self.cfg.enable and first_step > self.first:
            return (f"profiling: the run starts at step {first_step}, after profiling.start_step={self.first}: "
                    f"nothing is profiled")
        return None

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self, step: int) -> None:
        if not self.cfg.enable or step != self.first:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def _free_names(self) -> tuple[str, str]:
        """This rank's trace path and the ops table's, with the first suffix ('', '.run2', ...) under which neither
        exists yet: an earlier run's files in the folder are kept."""
        for n in range(1, 10_000):
            sfx = "" if n == 1 else f".run{n}"
            trace = os.path.join(self.folder, f"rank{self.rank}_steps{self.first}-{self.last}{sfx}.json.gz")
            ops = os.path.join(self.folder, f"ops{sfx}.txt")
            if not os.path.exists(trace) and (self.rank != 0 or not os.path.exists(ops)):
                return trace, ops
        raise FileExistsError(f"{self.folder} holds 10,000 profiles of steps {self.first}-{self.last}")

    def end(self, step: int) -> bool:
        """Close the window after its last step: True when it did (the caller restarts its throughput window)."""
        if self._prof is None or step != self.last:
            return False
        self._sync()
        wall_ms = (time.perf_counter() - self._t0) * 1e3 / self.cfg.steps
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        trace, ops = self._free_names()
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
