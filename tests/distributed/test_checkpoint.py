"""CheckpointManager across 2 torchrun ranks with FSDP2 on CPU/gloo: exact resume in a new process group, and a
save killed with SIGKILL mid-write leaves the previous checkpoint the latest and loadable.

The worker code is tests/distributed/_ckpt_worker.py.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_ckpt_worker.py")
NPROC = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={NPROC}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(WORKER), *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(OMP_NUM_THREADS="1", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    return env


def _torchrun(*args: str, timeout: float = 120) -> None:
    proc = subprocess.run(_cmd(*args), env=_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun {args} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-8000:]}"


def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_gone(pid: int, timeout: float = 30) -> None:
    """Until `pid` has exited (a zombie counts as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.05)
    raise AssertionError(f"worker {pid} still alive after SIGKILL")


def _results(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(NPROC)]


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_fsdp2_resume_is_bit_identical(tmp_path, async_mode):
    dump, out = tmp_path / "dump", tmp_path / "out"
    out.mkdir()
    _torchrun("first", str(dump), str(out), async_mode)
    _torchrun("resume", str(dump), str(out), async_mode)
    first, resume = _results(out, "first"), _results(out, "resume")
    for r in range(NPROC):
        assert first[r]["published_before_wait"] == (async_mode == "disabled")
        assert first[r]["checkpoints"] == [3]
        assert resume[r]["loaded"] == 3
        assert resume[r]["pos"] == 3 and resume[r]["last_epoch"] == 3
        assert resume[r]["draws"] == first[r]["draws"], f"rank {r}: RNG streams not restored"
        assert resume[r]["losses"] == first[r]["losses"], f"rank {r}: losses differ after resume"
    # Each rank has its own data and RNG: a mix-up between ranks would not go unnoticed.
    assert first[0]["losses"] != first[1]["losses"] and first[0]["draws"] != first[1]["draws"]


def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path):
    dump, out = tmp_path / "dump", tmp_path / "out"
    out.mkdir()
    root = dump / "checkpoint"
    proc = subprocess.Popen(_cmd("crash", str(dump), str(out)), env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    log: list[str] = []
    workers: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 90
        while len(workers) < NPROC:  # both ranks have begun saving step 2 ...
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "worker exited before saving step 2:\n" + "".join(log)
            log.append(line)
            workers.update(re.findall(r"SAVE2_STARTED (rank\d+) pid=(\d+)", line))
        tmp = root / "step-2.tmp"
        while not (tmp.is_dir() and sum(p.suffix == ".distcp" for p in tmp.iterdir()) == NPROC):  # ... are writing
            assert time.monotonic() < deadline, "step-2.tmp never got its data files:\n" + "".join(log)
            time.sleep(0.02)
        time.sleep(0.3)
    finally:
        # torchrun starts each worker in its own session: kill the saving workers themselves, then torchrun.
        for pid in workers.values():
            _sigkill(int(pid))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    for pid in workers.values():
        _wait_gone(int(pid))
    while (line := lines.get(timeout=10)) is not None:
        log.append(line)
    assert "SAVE2_DONE" not in "".join(log), "the save finished before the kill"

    assert (root / "step-2.tmp").is_dir() and not (root / "step-2").exists()
    assert not (root / "step-2.tmp" / ".metadata").exists()
    assert (root / "step-1" / ".metadata").is_file()

    _torchrun("verify", str(dump), str(out))
    for res in _results(out, "verify"):
        assert res["loaded"] == 1
        assert res["shards_equal"], f"rank {res['rank']}: the loaded shards differ from the step-1 ones"
        assert res["pos"] == 1
        assert res["checkpoints"] == [1, 2]
        assert res["entries"] == ["step-1", "step-2"], "the crashed save's step-2.tmp was not cleaned up"
