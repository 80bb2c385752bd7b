"""Two training runs' TensorBoard curves side by side: the FP8 issue's "loss curves within 1% at the end" check
(BF16 vs the FP8 split through train.py), or any two runs of the same config.

    python scripts/compare_runs.py outputs/bf16 outputs/fp8 [--tag loss] [--last 20] [--max-rel 0.01] [--json]

Each run is a train.py dump folder (its events under <dir>/tb) or the tb folder itself. The steps both runs logged
are aligned; the end is the mean of the last --last common steps (single-step losses are noisy: log every step,
--metrics.log_freq 1, for a dense end window). Prints the curves at a few steps, both end means and their relative
difference |b - a| / |a|. With --max-rel the exit status is 1 when that difference exceeds it; a missing folder,
no events or no common step exits 2 naming it.

--floor RUN (repeatable): a run of a's own config that differs from it only in numerical noise (another CPU thread
count, the GPU's non-deterministic kernels). Two such runs drift apart too: on the debug model over 200 CPU steps the
end means of two BF16 runs differ by 2.4-3.6% (docs/performance.md), more than the FP8 issue's 1%. The script prints
each floor's difference from a, and --max-floor-ratio K exits 1 when |b - a| / |a| exceeds K times the largest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_scalars(run: str, tag: str) -> dict[int, float]:
    """step -> value of `tag` from the run's TensorBoard events (the last value written wins for a repeated step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = Path(run)
    if not path.is_dir():
        raise SystemExit(_fail(f"{run}: no such folder"))
    tb = path / "tb" if (path / "tb").is_dir() else path
    files = sorted(tb.glob("events.out.tfevents.*"))
    if not files:
        raise SystemExit(_fail(f"{tb}: no TensorBoard event files (events.out.tfevents.*)"))
    out: dict[int, float] = {}
    for f in files:  # a resumed run writes one file per start
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars(tag)})
    if not out:
        raise SystemExit(_fail(f"{tb}: no scalar {tag!r}"))
    return out


def _fail(message: str) -> int:
    print(f"compare_runs.py: {message}", file=sys.stderr)
    return 2


def compare(a: dict[int, float], b: dict[int, float], *, last: int) -> dict:
    steps = sorted(set(a) & set(b))
    if not steps:
        raise SystemExit(_fail(f"the runs share no logged step (a: {min(a)}-{max(a)}, b: {min(b)}-{max(b)})"))
    end = steps[-last:]
    mean_a = sum(a[s] for s in end) / len(end)
    mean_b = sum(b[s] for s in end) / len(end)
    return dict(common_steps=len(steps), first=steps[0], last=steps[-1], end_steps=[end[0], end[-1]],
                end_mean_a=mean_a, end_mean_b=mean_b, end_rel_diff=abs(mean_b - mean_a) / abs(mean_a),
                curve=[(s, a[s], b[s]) for s in steps[:: max(1, len(steps) // 10)]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a")
    p.add_argument("run_b")
    p.add_argument("--tag", default="loss")
    p.add_argument("--last", type=int, default=20, help="common logged steps averaged at the end")
    p.add_argument("--max-rel", type=float, default=None, help="exit 1 when the end means differ by more than this")
    p.add_argument("--floor", action="append", default=[], metavar="RUN",
                   help="a run of a's config differing only in numerical noise (repeatable): the noise floor")
    p.add_argument("--max-floor-ratio", type=float, default=None,
                   help="exit 1 when the end means differ by more than this times the largest floor difference")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.last < 1:
        p.error("--last must be >= 1")
    if a.max_floor_ratio is not None and not a.floor:
        p.error("--max-floor-ratio needs at least one --floor run")
    runs_a = read_scalars(a.run_a, a.tag)
    r = compare(runs_a, read_scalars(a.run_b, a.tag), last=a.last)
    r.update(tag=a.tag, run_a=a.run_a, run_b=a.run_b)
    floors = [compare(runs_a, read_scalars(f, a.tag), last=a.last) for f in a.floor]
    for f in floors:  # the floor must cover the same end window as a against b
        if f["end_steps"] != r["end_steps"]:
            raise SystemExit(_fail(f"a floor run ends at steps {f['end_steps']}, a against b at {r['end_steps']}"))
    r["floor_rel_diffs"] = [f["end_rel_diff"] for f in floors]
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{a.tag}: {r['common_steps']} common logged steps ({r['first']}-{r['last']})")
        print("| step | a | b |\n|---|---|---|")
        for s, va, vb in r["curve"]:
            print(f"| {s} | {va:.4f} | {vb:.4f} |")
        print(f"end (mean of steps {r['end_steps'][0]}-{r['end_steps'][1]}): a {r['end_mean_a']:.4f}, "
              f"b {r['end_mean_b']:.4f}, |b - a| / |a| = {100 * r['end_rel_diff']:.2f}%")
        for run, d in zip(a.floor, r["floor_rel_diffs"]):
            print(f"noise floor {run}: |floor - a| / |a| = {100 * d:.2f}%")
    if a.max_rel is not None and r["end_rel_diff"] > a.max_rel:
        print(f"compare_runs.py: the end means differ by {100 * r['end_rel_diff']:.2f}% > {100 * a.max_rel:.2f}%",
              file=sys.stderr)
        return 1
    if a.max_floor_ratio is not None and r["end_rel_diff"] > a.max_floor_ratio * max(r["floor_rel_diffs"]):
        print(f"compare_runs.py: the end means differ by {100 * r['end_rel_diff']:.2f}%, more than "
              f"{a.max_floor_ratio:g} x the noise floor's {100 * max(r['floor_rel_diffs']):.2f}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
