"""What is alive at a CUDA memory peak (or at an out-of-memory), grouped by the project's source line that
allocated it: the breakdown behind scripts/benchmark.py's `--memory-profile` and train.py's `[profiling] memory`.

torch's recorder (`torch.cuda.memory._record_memory_history`) keeps every allocation and free with its Python
stack; `live_at_peak` replays that trace, finds the moment the allocated bytes were highest (an `oom` event counts
as a peak, with the failed request added) and sums the blocks alive then by their innermost frame under
`torchtitan_glm/` (else the innermost frame at all). torch's memory_viz renders the same trace as a picture; this
prints the table a remote run can bring back as text.
"""

from __future__ import annotations

import os
from collections import defaultdict
from contextlib import contextmanager


def _key(frames: list[dict], root: str) -> str:
    for f in frames:
        path = f["filename"].replace(os.sep, "/")
        if root in path:
            return f"{path[path.index(root):]}:{f['line']} {f['name']}"
    if frames:
        f = frames[0]
        return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
    return "(no stack)"


def _replay(events: list[dict]):
    """After each event: (index, event, the live blocks by address, their total bytes); the dict is updated in place."""
    live, total = {}, 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        yield i, e, live, total


def live_at_peak(snapshot: dict, *, root: str = "torchtitan_glm/", device: int = 0) -> tuple[int, list[tuple]]:
    """(peak bytes of the traced allocations, [(bytes, count, source) ...] largest first) at the trace's peak.

    Blocks allocated before recording began are not in the trace: the peak is over the traced ones only.
    """
    events = snapshot["device_traces"][device]
    peak, peak_at, extra = -1, -1, 0
    for i, e, _, total in _replay(events):
        if e["action"] == "oom":
            peak, peak_at, extra = total + e["size"], i, e["size"]
            break
        if total > peak:
            peak, peak_at = total, i
    blocks: dict = {}
    for _, _, blocks, _ in _replay(events[:peak_at + 1]):  # replayed again up to the peak (no copy per new high)
        pass
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in blocks.values():
        g = groups[_key(e.get("frames", []), root)]
        g[0] += e["size"]
        g[1] += 1
    if extra:
        groups["(the failed request)"] = [extra, 1]
    rows = sorted(((b, n, k) for k, (b, n) in groups.items()), reverse=True)
    return peak, rows


def reserved_by_stream(snapshot: dict, *, device: int = 0) -> list[tuple[int, int, int, int]]:
    """[(stream, reserved bytes, allocated bytes, segments) ...] largest first, at the snapshot's moment.

    The caching allocator keeps a freed block in the pool of the stream that allocated it, so what one stream has
    cached another cannot reuse: the gap between the reserved and allocated peaks sits in these pools."""
    pools: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for seg in snapshot.get("segments", []):
        if seg.get("device", device) != device:
            continue
        p = pools[seg.get("stream", 0)]
        p[0] += seg["total_size"]
        p[1] += seg["allocated_size"]
        p[2] += 1
    return sorted(((s, r, a, n) for s, (r, a, n) in pools.items()), key=lambda row: -row[1])


def start_recording(*, max_entries: int = 2_000_000) -> None:
    """Record every CUDA allocation and free from now on, with its Python stack (torch's memory history)."""
    import torch

    torch.cuda.memory._record_memory_history(context="all", stacks="python", max_entries=max_entries)


def stop_recording() -> None:
    import torch

    torch.cuda.memory._record_memory_history(enabled=None)


@contextmanager
def recording(enabled: bool, *, max_entries: int = 2_000_000):
    """Record CUDA allocations with Python stacks while the block runs (nothing when not enabled)."""
    if not enabled:
        yield
        return
    start_recording(max_entries=max_entries)
    try:
        yield
    finally:
        stop_recording()


def breakdown(snapshot: dict, *, title: str, top: int = 30) -> str:
    """live_at_peak as a markdown table under a one-line heading, the `top` largest sources and the rest."""
    peak, rows = live_at_peak(snapshot)
    lines = [f"memory at the peak of {title}: {peak / 2**30:.2f} GiB traced", "| GiB | blocks | allocated at |",
             "|---|---|---|"]
    lines += [f"| {b / 2**30:.3f} | {n} | {k} |" for b, n, k in rows[:top]]
    rest = sum(b for b, _, _ in rows[top:])
    if rest:
        lines.append(f"| {rest / 2**30:.3f} | {sum(n for _, n, _ in rows[top:])} | (the rest) |")
    pools = reserved_by_stream(snapshot)
    if pools:
        lines += ["", "reserved when the snapshot was taken, by the stream whose pool holds it (stream 0: the "
                  "default):", "| stream | reserved GiB | allocated GiB | cached GiB | segments |",
                  "|---|---|---|---|---|"]
        lines += [f"| {hex(st) if st else 0} | {r / 2**30:.3f} | {a / 2**30:.3f} | {(r - a) / 2**30:.3f} | {n} |"
                  for st, r, a, n in pools]
    return "\n".join(lines)


def print_breakdown(snapshot: dict, *, title: str, top: int = 30) -> None:
    print(breakdown(snapshot, title=title, top=top), flush=True)
