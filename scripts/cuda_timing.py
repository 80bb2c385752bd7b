"""Median CUDA-event time of a callable, shared by the GPU micro-benchmarks (bench_dsa.py, bench_ce.py)."""

from __future__ import annotations

import statistics

import torch


def median_ms(fn, *, steps: int, warmup: int) -> float:
    """Median milliseconds of fn() over `steps` runs timed with CUDA events, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
