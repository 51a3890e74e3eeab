"""SIGTERM/SIGINT during training: finish the step, save, stop.

SIGTERM or SIGINT (Kubernetes preemption, Ctrl-C) lets the current step finish, saves a
checkpoint and returns with `TrainResult.signal` set; the CLI then exits with the conventional
status 128 + signal number (143 for SIGTERM, 130 for SIGINT), so a job controller sees
"terminated", not "succeeded", and restarts the job, which resumes from that checkpoint
(``checkpoint.resume: auto``). A second Ctrl-C aborts at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any


class StopSignal:
    """SIGTERM/SIGINT → finish the current step, save, stop. Installed for the duration of
    a `with` block (main thread only: Python delivers signals there)."""

    def __init__(self, log: Callable[[str], None]):
        self.signum: int | None = None
        self._log = log
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        self._log(
            f"received {signal.Signals(signum).name}: finishing this step, saving a checkpoint, then stopping"
            + (" (Ctrl-C again to abort now)" if signum == signal.SIGINT else "")
        )

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
