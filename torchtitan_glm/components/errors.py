"""Expected errors, and the guard that ends a multi-rank job on one rank's error, within seconds, reporting it once.

An expected error (config, data, tokenizer, checkpoint, HF weights, non-finite training) is printed as one line
naming the thing to fix (and, in a job of several ranks, the rank), without a traceback; any other exception prints
its traceback. A configuration error, and a setting that cannot continue the checkpoint it resumes, exit 2 (a usage
error, as before any process group starts); any other failure exits 1. The first rank to fail
claims a key in the process group's store: the ranks that fail because of it (a collective whose peer is gone,
the launcher's SIGTERM) stay quiet. The failing rank writes torchelastic's per-rank error file (torch's
`errors.record`; torchrun's failure summary shows it), and every rank aborts its process group and exits without
waiting on a barrier or a thread.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

__all__ = [
    "ExpectedError", "DataError", "TokenizerError", "CheckpointError", "ResumeMismatchError", "NonFiniteError",
    "is_expected", "one_line", "run_job", "EXIT_ERROR", "EXIT_USAGE", "EXIT_INTERRUPTED",
]

logger = logging.getLogger(__name__)

EXIT_ERROR = 1
EXIT_USAGE = 2  # what the config loader exits with: the command line or config asks for something impossible
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention for an interrupted command
_FIRST_FAILURE_KEY = "torchtitan_glm/first_failed_rank"  # + the torchelastic restart count: one per attempt
# A rank that fails because another one did waits this long before exiting (unless the launcher's SIGTERM ends it
# first), so torchrun's summary, which orders failures by their second of exit, names the rank that failed first.
_FOLLOWER_EXIT_DELAY_S = 2.0


class ExpectedError(Exception):
    """A failure whose message says what to fix (a file, a key, a step): reported as one line, no traceback."""

    exit_code = EXIT_ERROR

    def __init__(self, *args: Any, usage: bool = False) -> None:
        """usage: the fix is a setting (a config key or the command line), so the process exits 2 (EXIT_USAGE)."""
        super().__init__(*args)
        if usage:
            self.exit_code = EXIT_USAGE


class DataError(ExpectedError, ValueError):
    """A problem with the training data (data.paths, data.source, ...)."""


class TokenizerError(ExpectedError, ValueError):
    """A problem with data.tokenizer or its fit to the model's vocabulary."""


class CheckpointError(ExpectedError, RuntimeError):
    """A checkpoint that cannot be saved, found, verified or resumed from (or HF weights that cannot be loaded)."""


class ResumeMismatchError(ExpectedError, ValueError):
    """This run's settings cannot continue the checkpoint it resumes (a changed setting, nothing left to train):
    fixed on the command line, so it exits 2 like a config error."""

    exit_code = EXIT_USAGE


class NonFiniteError(ExpectedError, RuntimeError):
    """Training produced a non-finite loss or gradient norm (training.on_nonfinite)."""


def is_expected(e: BaseException) -> bool:
    """Errors whose message is the whole story: ours, config errors and model-argument (HF config) errors."""
    from torchtitan_glm.config import ConfigError
    from torchtitan_glm.models.glm5.args import ModelArgsError

    return isinstance(e, (ExpectedError, ConfigError, ModelArgsError))


def _exit_code(e: BaseException) -> int:
    """EXIT_USAGE for a config or model-argument error (also when found after start-up) and a resume mismatch."""
    from torchtitan_glm.config import ConfigError
    from torchtitan_glm.models.glm5.args import ModelArgsError

    if isinstance(e, (ConfigError, ModelArgsError)):
        return EXIT_USAGE
    return getattr(e, "exit_code", EXIT_ERROR) if isinstance(e, ExpectedError) else EXIT_ERROR


def one_line(e: BaseException) -> str:
    """The exception's message on one line (multi-line messages, e.g. DCP's, joined with '; ')."""
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def _claim_first_failure(rank: int) -> int | None:
    """Record `rank` as the job's first failure unless another rank already is; return the first failed rank.

    None when there is no process group or its store cannot be reached (then every failing rank reports).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank already talks to
        store.set_timeout(timedelta(seconds=5))
        key = f"{_FIRST_FAILURE_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return int(store.compare_set(key, "", str(rank)))
    except Exception:  # noqa: BLE001 - a dead store must not hide the error being reported
        return None


def _abort_process_group() -> None:
    """Abort every process group (NCCL: pending collectives return) instead of destroying it (which can wait)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - best effort: the process exits right after
            pass


class _Report:
    """What this rank does about its exception: report it (first failure) or follow quietly."""

    def __init__(self, e: BaseException) -> None:
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if several else 0
        self.interrupted = isinstance(e, KeyboardInterrupt)
        self.expected = is_expected(e)
        # Every rank gets the SIGINT: rank 0 says so, nobody waits for anybody.
        first = self.rank if self.interrupted else _claim_first_failure(self.rank)
        self.first = first is None or first == self.rank
        self.first_rank = first
        if self.interrupted:
            self.text = "interrupted: exiting now without saving" if self.rank == 0 else ""
        elif self.expected:
            self.text = f"error{f' on rank {self.rank}' if several else ''}: {one_line(e)}"
        else:
            self.text = f"error on rank {self.rank}, unexpected:\n" + "".join(traceback.format_exception(e)).rstrip()
        self.exit_code = EXIT_INTERRUPTED if self.interrupted else _exit_code(e)


class _JobErrorHandler(ErrorHandler):
    """torchelastic's error-file writer, told which rank failed first: only that rank writes the file, and an
    expected error is written as its one line (torchrun prints the file as the failure's root cause)."""

    def __init__(self) -> None:
        self.report: _Report | None = None

    def record_exception(self, e: BaseException) -> None:
        self.report = _Report(e)
        if not self.report.first:
            return
        if not self.report.expected:
            super().record_exception(e)
            return
        path = self._get_error_file_path()
        if path:
            line = self.report.text
            data = {"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                               "timestamp": str(int(time.time()))}}}
            with open(path, "w") as f:
                json.dump(data, f)


def run_job(fn: Callable[[], Any]) -> None:
    """Run the job; on an exception on this rank, report it once for the whole job, abort the process group and
    exit now (no barrier, no waiting for threads) with EXIT_ERROR, or EXIT_INTERRUPTED on a KeyboardInterrupt."""
    handler = _JobErrorHandler()
    try:
        record(fn, error_handler=handler)()
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - every failure ends the job the same way
        report = handler.report or _Report(e)  # record() sees Exceptions only, not KeyboardInterrupt
        for sig in (signal.SIGTERM, signal.SIGINT):  # a launcher's SIGTERM now ends us at once
            signal.signal(sig, signal.SIG_DFL)
        if report.first and report.text:
            sys.stderr.write(report.text + "\n")  # one write: print's separate newline could land after another
            sys.stderr.flush()                     # rank's output on the shared stream
        elif report.rank == 0:
            logger.info("stopping because rank %s failed (that rank reports the error)", report.first_rank)
        _abort_process_group()
        if not report.first:
            time.sleep(_FOLLOWER_EXIT_DELAY_S)
        exit_now(report.exit_code)


def exit_now(code: int) -> None:
    """Flush the logs and streams, then exit without interpreter teardown.

    After an error, background threads (an async checkpoint write, a blocked collective) could otherwise keep a
    failed rank alive. After a finished distributed run, the teardown destroys c10d objects still referenced from
    Python (device meshes, compiled graphs) after their threads: on CPU/gloo that aborted (SIGABRT, "terminate
    called without an active exception") ranks whose run had completed and saved everything (torch 2.13, seen in
    CI in 3 of ~20 torchrun tests of one run)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)
