"""Retrying a unit of database work through a transient failure (a restart, a dropped
connection, SQLite's "database is locked" after its busy timeout).

The unit is a whole transaction: `fn` opens its own (sessions.begin()), so a retry starts
from a clean one, and must be safe to repeat: a commit whose reply was lost with the
connection may have happened, so `fn` checks what it finds (the job repository's claim and
store are conditional UPDATEs, and `stored_by` tells a lost reply from a lost write).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

from sqlalchemy import exc

T = TypeVar("T")

log = logging.getLogger("structspec.db")

FIRST_WAIT_S = 0.25
MAX_WAIT_S = 5.0


def is_transient(error: BaseException) -> bool:
    """A failure that says nothing about the work itself: the database was unreachable, the
    connection died, or a lock wait timed out. Everything else (a constraint, a bug) is not."""
    if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, (exc.OperationalError, exc.InterfaceError, exc.TimeoutError))


def retrying(fn: Callable[[], T], *, what: str, budget_s: float, sleep: Callable[[float], None] = time.sleep,
             clock: Callable[[], float] = time.monotonic) -> T:
    """fn(), tried again after transient errors with doubling waits (0.25 s .. 5 s) for up to
    `budget_s` seconds; then, or at once for any other error, the error is raised. Each retry
    is logged as a warning naming `what`."""
    deadline = clock() + budget_s
    wait = FIRST_WAIT_S
    attempt = 1
    while True:
        try:
            return fn()
        except Exception as e:
            if not is_transient(e) or clock() + wait > deadline:
                raise
            log.warning("%s failed (database unavailable, attempt %d): %s; retrying in %.2f s", what, attempt,
                        " ".join(str(e.orig if isinstance(e, exc.DBAPIError) else e).split())[:300], wait)
        sleep(wait)
        wait = min(wait * 2, MAX_WAIT_S)
        attempt += 1
