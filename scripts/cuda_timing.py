"""Median CUDA-event time of a callable, the closing table and argument types, shared by the GPU micro-benchmarks
(bench_dsa.py, bench_ce.py, bench_kda.py, bench_mhc.py, bench_optim.py, bench_causal_conv.py,
bench_sparse_mla_configs.py; bench_decode.py and sparse_mla_sass.py its argument types)."""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable

import torch


def at_least(least: int):
    """argparse type: an integer >= least (a bad value is an argparse error, exit 2, before a GPU is asked for)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value

    return parse


def int_list(least: int = 1):
    """argparse type: comma-separated integers, each >= least, at least one ("4096,8192")."""
    one = at_least(least)

    def parse(text: str) -> tuple[int, ...]:
        items = text.split(",")
        if not all(item.strip() for item in items):
            raise argparse.ArgumentTypeError(f"{text!r} has an empty entry")
        return tuple(one(item.strip()) for item in items)

    return parse


def kernel_configs(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """argparse type: ';'-separated Triton configs BLOCK_H,BLOCK_K,num_warps,num_stages, each four integers >= 1
    ("64,32,8,2;32,16,8,1"; the sparse backward's config scripts)."""
    one = int_list()
    configs = tuple(one(c) for c in text.split(";"))
    if any(len(c) != 4 for c in configs):
        raise argparse.ArgumentTypeError(f"{text!r}: each config is four integers BLOCK_H,BLOCK_K,num_warps,num_stages")
    return configs


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


def backward_step(call, dout: torch.Tensor, leaves) -> Callable[[], None]:
    """A closure for median_ms: call().backward(dout), then the leaves' gradients dropped (each run starts clean)."""

    def run():
        call().backward(dout)
        for t in leaves:
            t.grad = None

    return run


def print_table(title: str, columns: dict[str, str], rows: list[dict], json_path: str | None = None) -> None:
    """`title`, then a markdown table of `rows` ({header: row key} in `columns`),
    and the rows as JSON to `json_path` if given."""
    print(f"\n{title}\n")
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in columns.values()) + " |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
