"""What /health and /metrics read, cached for a second per API process.

Both are open routes that probes and scrapers call on their own schedule, outside the rate
limit; each answer reads the database (and /health connects to the broker). A `ProbeCache`
keeps the last answer for `ttl_s` seconds and lets one caller at a time compute a new one
while the others wait for it and share it, so a flood of probes costs at most one read per
`ttl_s` per process, and an answer is never older than `ttl_s` plus the read's own bound. A
read that raises is cached too (re-raised until it expires): during an outage the probes do
not each wait for the database's connect timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable

TTL_S = 1.0  # how stale a probe's answer may be; a second is finer than any probe interval


class ProbeCache:
    """The answer of `compute` per key, reused for `ttl_s` seconds (`clock`: monotonic seconds)."""

    def __init__(self, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: dict[Hashable, tuple[float, bool, Any]] = {}  # key -> (read at, ok, value or error)
        self._lock = threading.Lock()  # one read at a time; waiters then find it fresh

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or self.clock() - entry[0] >= self.ttl_s:
                started = self.clock()  # the answer is as old as the start of its read
                try:
                    entry = (started, True, compute())
                except Exception as e:
                    entry = (started, False, e)
                self._entries[key] = entry
        _, ok, value = entry
        if not ok:
            raise value
        return value
