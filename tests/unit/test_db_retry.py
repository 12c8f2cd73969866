"""structspec/db/retry.py: which errors are retried, for how long, and that others are not."""

from __future__ import annotations

import pytest
from sqlalchemy import exc

from structspec.db.retry import is_transient, retrying


def operational(msg="terminating connection due to administrator command"):
    return exc.OperationalError("UPDATE jobs ...", {}, Exception(msg))


class Clock:
    def __init__(self):
        self.t = 0.0
        self.waits = []

    def sleep(self, s):
        self.waits.append(s)
        self.t += s

    def __call__(self):
        return self.t


def test_transient_errors_are_retried_with_growing_waits_until_it_works():
    clock, calls = Clock(), []

    def fn():
        calls.append(1)
        if len(calls) < 5:
            raise operational()
        return "ok"

    assert retrying(fn, what="claim", budget_s=30, sleep=clock.sleep, clock=clock) == "ok"
    assert clock.waits == [0.25, 0.5, 1.0, 2.0]


def test_retrying_gives_up_after_its_budget_and_raises_the_last_error():
    clock = Clock()

    def fn():
        raise operational("connection refused")

    with pytest.raises(exc.OperationalError, match="connection refused"):
        retrying(fn, what="store", budget_s=10, sleep=clock.sleep, clock=clock)
    assert sum(clock.waits) <= 10 and clock.waits[-1] <= 5.0 and len(clock.waits) >= 4


def test_other_errors_are_not_retried():
    clock, calls = Clock(), []

    def fn():
        calls.append(1)
        raise exc.IntegrityError("INSERT", {}, Exception("duplicate key"))

    with pytest.raises(exc.IntegrityError):
        retrying(fn, what="store", budget_s=30, sleep=clock.sleep, clock=clock)
    assert calls == [1] and clock.waits == []
    assert not is_transient(ValueError("x")) and is_transient(operational())
    assert is_transient(exc.DBAPIError("SELECT 1", {}, Exception("gone"), connection_invalidated=True))
