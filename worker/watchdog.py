"""The engine watchdog: a worker process whose engine loop makes no progress while it holds work
(a kernel that never returns, a step stuck on a lock, the loop's thread dead) exits for its
supervisor instead of holding its jobs for good.

Exiting rather than restarting the engine in place: a thread stuck inside a kernel cannot be
stopped from Python, and what it holds (memory, device state, locks) cannot be trusted or freed;
a fresh process starts clean, and a worker already has a supervisor to start it (systemd,
Kubernetes, the prefork pool for its children). Before exiting the process stops renewing its
leases (worker/tasks.py, engine_hung), so the reaper of any worker re-queues its jobs once their
leases run out; each such run counts as an attempt, and a job that hangs every engine fails
after STRUCTSPEC_JOB_MAX_ATTEMPTS.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("structspec.worker")

# sysexits.h EX_TEMPFAIL, "a temporary failure, retry later": a supervisor restarts the worker
EXIT_ENGINE_HUNG = 75


class Watchdog:
    """From start() to stop(), asks `loop.hung(limit_s)` (engine/loop.py) every tenth of the
    limit (0.1 to 5 s); the first reason it gives goes to `on_hung`, once, and the watchdog ends."""

    def __init__(self, loop, limit_s: float, on_hung: Callable[[str], None], name: str = "engine-watchdog"):
        self.loop, self.limit_s, self.on_hung = loop, limit_s, on_hung
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        interval = min(max(self.limit_s / 10, 0.1), 5.0)
        while not self._stop.wait(interval):
            reason = self.loop.hung(self.limit_s)
            if reason is not None:
                self.on_hung(reason)
                return
