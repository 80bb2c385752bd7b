"""Failures that stop cleanly and lose nothing, through torchrun on 2 CPU ranks (gloo): one rank's error ends the
job within seconds and is reported once; bad data stops every rank before training; a non-finite loss stops (or
skips) without saving that state; SIGTERM/SIGINT save the step reached and the resumed run is bit-exact; resuming
explains itself. (Checkpoint verification and the other single-process parts: tests/unit/.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.test_train import ROOT, SHORT, _command, _kill_all, _losses, _tb_losses

WORKER = Path(__file__).with_name("_failing_worker.py")
# A short job without checkpoints or TensorBoard (tests turn on what they look at).
FAST = ["--config", "train_configs/debug_model.toml", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.steps", "6", "--lr_scheduler.warmup_steps", "0", "--metrics.log_freq", "1",
        "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"]
# A worker's own traceback would show frames from the package (torchrun's own traceback does not).
PACKAGE_FRAME = f'File "{ROOT / "torchtitan_glm"}'


def _run(args: list[str], dump: Path, *, script: Path = ROOT / "train.py", env: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, str, str, float]:
    """Run a torchrun job to its end (returncode, stdout, stderr, seconds); a job still running after `timeout`
    (e.g. hung in a collective) is killed, with every process holding `dump` in its command line, and fails."""
    cmd, full_env = _command(args + [f"--job.dump_folder={dump}"], script=script, env=env)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(proc, marker=str(dump))
        pytest.fail(f"the job was still running after {timeout} s (hung); killed it")
    return proc.returncode, out, err, time.monotonic() - start


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error")]


def _without_rank(line: str) -> str:
    """An expected error's line with the rank that reported it taken out ("error on rank 1: x" -> "error: x"); the
    rank must be there, as in any job of several ranks."""
    assert re.match(r"error on rank \d+: ", line), line
    return re.sub(r"^error on rank \d+: ", "error: ", line)


def _root_cause(stderr: str) -> str:
    """torchrun's 'Root Cause' section of its failure summary."""
    assert "Root Cause (first observed failure)" in stderr, stderr[-3000:]
    return stderr.split("Root Cause (first observed failure)", 1)[1]


# ----------------------------------------------------------------------------------------- one rank fails
@pytest.mark.parametrize("kind", ["expected", "unexpected"])
def test_an_error_on_one_rank_ends_the_job_within_seconds_reported_once(tmp_path, kind):
    env = {"TTG_FAIL_RANK": "1", "TTG_FAIL_STEP": "3", "TTG_FAIL_KIND": kind}
    code, out, err, seconds = _run(FAST, tmp_path, script=WORKER, env=env)
    assert code != 0 and seconds < 60
    assert sorted(_losses(out)) == [1, 2], "the failure was injected at step 3"
    root = _root_cause(err)
    assert "rank      : 1 (local_rank: 1)" in root, "torchrun names the rank that failed first"
    if kind == "expected":
        line = "error on rank 1: injected: rank 1 cannot use its batch at step 3"
        assert _error_lines(err) == [line], err[-3000:]
        assert f"traceback : {line}" in root  # the per-rank error file holds the one line
        assert PACKAGE_FRAME not in err + out, "an expected error prints no traceback"
    else:
        assert _error_lines(err) == ["error on rank 1, unexpected:"], err[-3000:]
        # Its traceback once from rank 1, once in torchrun's summary (from the error file); nothing from rank 0.
        assert err.count("RuntimeError: injected: rank 1 crashed at step 3") == 2
        assert "RuntimeError: injected: rank 1 crashed at step 3" in root
        assert "Connection closed" not in err and "DistBackendError" not in err


# ------------------------------------------------------------------------------------------------- data
def _bad_jsonl(folder: Path) -> tuple[list[str], str]:
    path = folder / "docs.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 30}) for i in range(300)]
    lines.insert(250, '{"text": "an unterminated string}')
    path.write_text("\n".join(lines) + "\n")
    return ["--data.source", "jsonl", f"--data.paths={path}"], f"error: {path}:251: invalid JSON"


def _bad_bin(folder: Path) -> tuple[list[str], str]:
    path = folder / "tokens.bin"
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=20_000).astype(np.uint16)
    tokens[rng.random(tokens.size) < 0.05] = 257  # the byte tokenizer's eos: documents of ~20 tokens
    tokens[100] = 600  # in the second row: the debug model's vocab_size is 512
    tokens.tofile(path)
    return ["--data.source", "bin", f"--data.paths={path}"], (
        f"error: token file {path} holds token id 600 at position 100, but the model's vocab_size is 512")


@pytest.mark.parametrize("make", [_bad_jsonl, _bad_bin], ids=["jsonl", "bin"])
def test_bad_data_stops_every_rank_before_training(tmp_path, make):
    data_args, message = make(tmp_path)
    code, out, err, seconds = _run(FAST + data_args, tmp_path / "run")
    assert code != 0 and seconds < 60
    assert not _losses(out), "the data is checked before the first step"
    lines = _error_lines(err)
    assert len(lines) == 1 and re.match(r"error on rank [01]: ", lines[0]), err[-3000:]
    assert lines[0].split(": ", 1)[1].startswith(message.removeprefix("error: ")), err[-3000:]
    assert PACKAGE_FRAME not in err + out


# --------------------------------------------------------------------------------------------- NaN / Inf
NAN = FAST + ["--optimizer.lr", "1e4", "--checkpoint.enable", "true", "--checkpoint.interval", "1",
              "--checkpoint.keep_latest_k", "0", "--metrics.enable_tensorboard", "true"]
NONFINITE = re.compile(r"^error on rank [01]: "
                       r"(?:non-finite (?P<what>.+?) at step (?P<step>\d+) \(training\.on_nonfinite='stop'\)|"
                       r"3 steps in a row .* the last, step (?P<last>\d+),)")


def _checkpoints(dump: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*"))


def test_nonfinite_stop_names_the_step_and_the_batch_and_saves_nothing_of_it(tmp_path):
    code, out, err, _ = _run(NAN, tmp_path)
    assert code != 0
    lines = _error_lines(err)
    assert len(lines) == 1 and (m := NONFINITE.match(lines[0])), err[-3000:]
    step = int(m["step"])
    assert max(_losses(out)) == step - 1  # the failing step is not logged as a normal step
    assert _checkpoints(tmp_path) == list(range(1, step)), "the non-finite state must not be saved"
    listing = tmp_path / f"nonfinite-step-{step}.txt"
    docs = listing.read_text().split()
    assert docs and all(os.path.isfile(d) for d in docs), "the batch's documents (stdlib files) are listed"
    assert f"The step's batch came from {docs[0]}" in lines[0] and str(listing) in lines[0]


def test_nonfinite_skip_counts_in_tensorboard_and_stops_after_n_in_a_row(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    code, out, err, _ = _run(NAN + ["--training.on_nonfinite", "skip", "--training.max_consecutive_nonfinite", "3"],
                             tmp_path)
    assert code != 0
    lines = _error_lines(err)
    assert len(lines) == 1 and (m := NONFINITE.match(lines[0])) and m["last"], err[-3000:]
    last = int(m["last"])
    skipped = [int(s) for s in re.findall(r"step (\d+): non-finite .*: skipped its optimizer step", out)]
    assert skipped == [last - 2, last - 1]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = acc.Scalars("skipped_steps")
    assert len(events) == len({e.step for e in events}), "one skipped_steps event per step"
    counts = {e.step: e.value for e in events}
    assert {s: counts[s] for s in (last - 2, last - 1, last)} == {last - 2: 1, last - 1: 2, last: 3}
    assert all(counts[s] == 0 for s in range(1, last - 2))
    assert _checkpoints(tmp_path) == list(range(1, last)), "skipped steps keep (and save) the last finite state"


# ----------------------------------------------------------------------------------------------- signals
def _worker_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker process of `rank` (from its environment)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(pid)
        except (OSError, IndexError, ValueError):
            continue
    raise AssertionError(f"no rank-{rank} worker of torchrun {torchrun_pid}")


@pytest.mark.parametrize("sig", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.long)])
def test_signal_saves_the_step_reached_and_the_resumed_run_is_exact(tmp_path, reference_run, sig):
    """SIGTERM (preemption) reaches one worker only: the ranks still stop at the same step, the job exits 0.
    SIGINT (Ctrl-C) reaches torchrun, which forwards it to the workers (torchrun itself then exits non-zero)."""
    full_dir, _ = reference_run
    dump = tmp_path / "run"
    cmd, env = _command(SHORT + [f"--job.dump_folder={dump}"])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    log: list[str] = []
    try:
        for line in proc.stdout:
            log.append(line)
            if line.startswith("step 3/20"):
                break
        else:
            pytest.fail("the job ended before step 3:\n" + "".join(log[-50:]))
        target = _worker_pid(proc.pid, rank=1) if sig == "SIGTERM" else proc.pid
        os.kill(target, getattr(signal, sig))
        rest, _ = proc.communicate(timeout=60)
    except BaseException:
        _kill_all(proc, marker=str(dump))
        raise
    text = "".join(log) + rest
    reached = max(_losses(text))
    assert 3 <= reached < 20
    assert _checkpoints(dump)[-1] == reached, "a checkpoint of the step reached"
    who = sig if sig == "SIGINT" else "a signal on another rank"  # rank 0 speaks; SIGTERM went to rank 1
    assert f"stopped by {who} after step {reached} of 20: saved checkpoint {dump / 'checkpoint'}/step-{reached}" in text
    assert PACKAGE_FRAME not in text and "KeyboardInterrupt" not in text
    if sig == "SIGTERM":
        assert proc.returncode == 0, text[-3000:]

    code, out, err, _ = _run(SHORT + ["--metrics.save_tb_folder=tb_resumed"], dump, timeout=240)
    assert code == 0, err[-3000:]
    ckpt = dump / "checkpoint" / f"step-{reached}"
    assert f"resumed from the step-{reached} checkpoint {ckpt}, training to step 20" in out
    assert sorted(_losses(out)) == list(range(reached + 1, 21))
    full, resumed = _tb_losses(full_dir / "tb"), _tb_losses(dump / "tb_resumed")
    for step in range(reached + 1, 21):
        assert resumed[step] == full[step], f"step {step}: resumed {resumed[step]!r} != uninterrupted {full[step]!r}"


# ------------------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("case", ["fewer_steps", pytest.param("seq_len", marks=pytest.mark.long),
                                  pytest.param("corrupt_newest_and_longer_schedule", marks=pytest.mark.long)])
def test_resume_explains_itself(tmp_path, reference_run, case):
    full_dir, _ = reference_run
    dump = tmp_path / "run"
    shutil.copytree(full_dir / "checkpoint", dump / "checkpoint")
    root = dump / "checkpoint"
    if case == "fewer_steps":
        code, out, err, _ = _run(SHORT + ["--training.steps", "5"], dump)
        assert code != 0 and "exitcode:2" in _root_cause(err).replace(" ", ""), err[-3000:]
        assert [_without_rank(line) for line in _error_lines(err)] == [
            f"error: training.steps=5 is below the step of the checkpoint to resume, {root}/step-20: nothing to "
            "train. Raise --training.steps above 20 to continue, pick an earlier checkpoint with "
            "--checkpoint.load_step, or start fresh with a new --job.dump_folder"], err[-3000:]
    elif case == "seq_len":
        code, out, err, _ = _run(SHORT + ["--training.seq_len", "32"], dump)
        assert code != 0
        # torchrun exits 1; the worker's 2 (a usage error, like a config error's) is in its summary
        assert "exitcode:2" in _root_cause(err).replace(" ", ""), err[-3000:]
        lines = [_without_rank(line) for line in _error_lines(err)]
        assert len(lines) == 1 and lines[0].startswith(
            f"error: cannot resume from {root}/step-20: training.seq_len was 64, is 32; an exact resume needs the "
            "same values"), err[-3000:]
    else:
        distcp = sorted((root / "step-20").glob("*.distcp"))[1]
        data = bytearray(distcp.read_bytes())
        mid = len(data) // 2  # tensor payload: DCP itself would load it without noticing
        data[mid:mid + 4096] = bytes(b ^ 0xFF for b in data[mid:mid + 4096])
        distcp.write_bytes(bytes(data))
        code, out, err, _ = _run(SHORT + ["--training.steps", "22", "--metrics.save_tb_folder=tb_resumed"], dump,
                                 timeout=240)
        assert code == 0, err[-3000:]
        assert out.count("skipping checkpoint") == 1
        assert (f"skipping checkpoint {root}/step-20 (is corrupt: {distcp.name} does not match its checksum); "
                "resuming from step-10, the newest checkpoint that verifies") in out
        assert f"resumed from the step-10 checkpoint {root}/step-10, training to step 22" in out
        assert re.search(r"the LR schedule changed since the checkpoint \(training\.steps 20 -> 22\): step 11 runs at "
                         r"lr \S+ where the saved schedule gives \S+", out), out[-3000:]
        # The step-10 state was loaded exactly: step 11's loss (computed before its update) is the reference's.
        assert _tb_losses(dump / "tb_resumed")[11] == _tb_losses(full_dir / "tb")[11]
        assert sorted(_losses(out)) == list(range(11, 23))
