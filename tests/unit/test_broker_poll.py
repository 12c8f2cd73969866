"""The embedded broker's poll (worker/app.py: drain_polling_by_load): a look at the queue every
EMBEDDED_BROKER_POLL_S while the engine is idle, every EMBEDDED_BROKER_BUSY_POLL_S while it is
busy (EMBEDDED_BROKER_RUNG_BUSY_POLL_S with a doorbell), at once when it goes idle; a message
ends the wait; the timeout is kept. On a fake clock."""

from __future__ import annotations

import os
import socket
import threading
import time
from queue import Empty

import pytest

import structspec.worker.app as app_module
from structspec.db import bells
from structspec.worker.app import (EMBEDDED_BROKER_BUSY_POLL_S, EMBEDDED_BROKER_POLL_S, EMBEDDED_BROKER_RUNG_BUSY_POLL_S,
                        drain_polling_by_load)


class Clock:
    def __init__(self):
        self.now = 0.0
        self.hooks = []  # (at, fn): run once the clock reaches `at`

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
        for at, fn in list(self.hooks):
            if self.now >= at:
                self.hooks.remove((at, fn))
                fn()


class Transport:
    """What drain_events uses of kombu's virtual Transport: a cycle whose get raises Empty until
    a message is put, then delivers it."""

    def __init__(self, clock):
        self.clock, self.looks, self.message, self.delivered = clock, [], None, []
        self.cycle = self

    def get(self, callback, timeout=None):
        self.looks.append(round(self.clock.now, 3))
        if self.message is None:
            raise Empty()
        callback(self.message, "q")
        self.message = None

    def _deliver(self, message, queue):
        self.delivered.append(message)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(app_module, "monotonic", c.monotonic)
    monkeypatch.setattr(app_module, "sleep", c.sleep)
    monkeypatch.setattr(app_module, "_engine_busy", lambda: False)
    monkeypatch.setattr(app_module, "_broker_url", None)  # no doorbell: the fake clock's sleep
    return c


def gaps(looks):
    return [round(b - a, 3) for a, b in zip(looks, looks[1:])]


def test_idle_it_looks_every_tick_and_a_message_ends_the_wait(clock):
    t = Transport(clock)
    clock.hooks.append((0.2, lambda: setattr(t, "message", "job")))
    drain_polling_by_load(t, None, timeout=2.0)
    assert t.delivered == ["job"]
    assert set(gaps(t.looks)) == {EMBEDDED_BROKER_POLL_S} and t.looks[-1] == pytest.approx(0.2, abs=0.06)


def test_busy_it_looks_seldom_and_at_once_when_the_engine_goes_idle(clock, monkeypatch):
    busy = [True]
    monkeypatch.setattr(app_module, "_engine_busy", lambda: busy[0])
    t = Transport(clock)
    clock.hooks.append((1.27, lambda: busy.__setitem__(0, False)))
    with pytest.raises(socket.timeout):
        drain_polling_by_load(t, None, timeout=2.0)
    busy_looks = [x for x in t.looks if x < 1.27]
    assert set(gaps(busy_looks)) == {EMBEDDED_BROKER_BUSY_POLL_S}  # 0, 0.2, ..., 1.2
    # idle again: the next look within a tick of it, then one every tick until the timeout
    after = [x for x in t.looks if x >= 1.27]
    assert after[0] - 1.27 <= EMBEDDED_BROKER_POLL_S + 1e-9
    assert set(gaps(after)) <= {EMBEDDED_BROKER_POLL_S} and clock.now == pytest.approx(2.0, abs=0.06)


class QuietBell:
    """A doorbell on the fake clock that nobody rings."""

    def __init__(self, clock):
        self.clock = clock

    def wait(self, seconds):
        self.clock.sleep(seconds)
        return False


def test_busy_with_its_doorbell_it_looks_only_as_a_safety_net(clock, monkeypatch):
    """Every publish through `enqueue` rings the doorbell, so while the engine is busy the looks
    are spaced EMBEDDED_BROKER_RUNG_BUSY_POLL_S apart (each is Python holding the engine's GIL)."""
    assert EMBEDDED_BROKER_RUNG_BUSY_POLL_S > EMBEDDED_BROKER_BUSY_POLL_S
    monkeypatch.setattr(app_module, "_engine_busy", lambda: True)
    monkeypatch.setattr(app_module, "_broker_url", "sqla+sqlite:///unused.db")
    monkeypatch.setattr(app_module, "_bell", QuietBell(clock))
    monkeypatch.setattr(app_module, "_bell_pid", os.getpid())
    t = Transport(clock)
    with pytest.raises(socket.timeout):
        drain_polling_by_load(t, None, timeout=3 * EMBEDDED_BROKER_RUNG_BUSY_POLL_S + 0.5)
    assert gaps(t.looks) == [EMBEDDED_BROKER_RUNG_BUSY_POLL_S] * 3


def test_the_embedded_broker_uses_it(tmp_path):
    from kombu.transport import sqlalchemy as sqla_transport

    from structspec.config import Settings
    from structspec.worker.app import make_celery

    make_celery(Settings(broker_url=f"sqla+sqlite:///{tmp_path}/broker.sqlite"))
    assert sqla_transport.Transport.drain_events is drain_polling_by_load


class RealClock:
    @property
    def now(self):
        return time.monotonic()


def test_a_ring_makes_it_look_at_once(tmp_path, monkeypatch):
    """With its doorbell (structspec/db/bells.py), on the real clock: a job published during a
    30 s wait between looks is seen at once, not at the next look."""
    url = f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    monkeypatch.setattr(app_module, "EMBEDDED_BROKER_POLL_S", 30.0)
    monkeypatch.setattr(app_module, "_engine_busy", lambda: False)
    monkeypatch.setattr(app_module, "_broker_url", url)
    monkeypatch.setattr(app_module, "_bell_pid", None)
    monkeypatch.setattr(app_module, "_bell", None)  # this test's bell is gone after it
    t = Transport(RealClock())

    def publish():
        time.sleep(0.2)
        t.message = "job"
        assert bells.ring(url, bells.WORKER) == 1

    threading.Thread(target=publish).start()
    start = time.monotonic()
    try:
        drain_polling_by_load(t, None, timeout=60.0)
    finally:
        app_module._bell.close()
    assert t.delivered == ["job"] and len(t.looks) == 2
    assert time.monotonic() - start < 15.0
