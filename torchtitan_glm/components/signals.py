"""Graceful stop on SIGTERM (cluster preemption) and SIGINT (Ctrl-C): the first signal asks the training loop to
finish its step, save a checkpoint and exit; a second SIGINT exits at once (KeyboardInterrupt)."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

__all__ = ["StopRequest"]

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Installs the handlers (main thread only) while active; `signum` is the first signal received, else None.

    The flag is local to this process: the training loop turns it into a decision every rank shares (one
    all-reduce per step), since the signal may reach the ranks at different moments.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            logger.info("received %s: finishing this step, then saving a checkpoint and exiting%s",
                        signal.Signals(signum).name, " (Ctrl-C again exits now, without saving)"
                        if signum == signal.SIGINT else "")
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
