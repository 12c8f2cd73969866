"""Doorbells between processes sharing a SQLite file (structspec/db/bells.py): a ring wakes the
bells of its role, a gone bell is cleared, other databases have none; the API's job waiter
reads at once when rung (the embedded broker's poll: tests/unit/test_broker_poll.py). The poll
is set to 30 s here, so a ring that did not wake it would show as a wait of that length."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from structspec.api.services import waiting
from structspec.api.services.waiting import JobWaiter
from structspec.db import bells
from structspec.db.session import make_engine

LONG_POLL = 30.0


def test_a_ring_wakes_the_bells_of_its_role_only(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    worker, api = bells.Bell.open(url, bells.WORKER), bells.Bell.open(url, bells.API)
    try:
        assert worker is not None and api is not None
        assert not worker.wait(0.01)  # nothing rang: its whole time, then False
        assert bells.ring(url, bells.WORKER) == 1
        assert worker.wait(LONG_POLL)
        assert not api.drain()
        assert bells.ring(url, bells.API) == 1 and bells.ring(url, bells.API) == 1
        assert api.drain() and not api.drain()  # both rings taken at once
    finally:
        worker.close()
        api.close()
    assert sorted(p.name for p in bells.bells_dir(url).iterdir()) == []  # closing removes the socket


def test_a_bell_whose_process_is_gone_is_removed_by_the_next_ring(tmp_path):
    url = f"sqlite:///{tmp_path / 'x.db'}"
    bell = bells.Bell.open(url, bells.API)
    bell._sock.close()  # as a killed process leaves it: the socket file stays, nobody reads it
    assert bell.path.exists()
    assert bells.ring(url, bells.API) == 0
    assert not bell.path.exists()


def test_no_bells_beside_other_databases_or_where_the_path_is_too_long(tmp_path):
    assert bells.bells_dir("postgresql://u@h/db") is None and bells.bells_dir("redis://h:6379/0") is None
    assert bells.bells_dir("sqlite://") is None  # in memory
    assert bells.ring("postgresql://u@h/db", bells.API) == 0
    assert bells.ring(f"sqlite:///{tmp_path / 'never.db'}", bells.API) == 0  # no directory yet
    deep = tmp_path / ("d" * 120)
    assert bells.Bell.open(f"sqlite:///{deep / 'x.db'}", bells.API) is None  # polls alone
    assert bells.bells_dir(f"sqla+sqlite:///{tmp_path / 'broker.db'}") == tmp_path / "broker.db.bells"


def test_the_job_waiter_reads_at_once_when_a_worker_rings(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'w.db'}"
    monkeypatch.setattr(waiting, "SQLITE_POLL_S", LONG_POLL)
    job = uuid.uuid4()

    async def main():
        waiter = JobWaiter(make_engine(url), url)
        state = {job: ("running", 0)}
        waiter._states = lambda ids: {i: state[i] for i in ids if i in state}
        await waiter.start()
        try:
            assert waiter._bell is not None
            with waiter.subscribe(job) as event:
                await asyncio.sleep(0.05)
                assert bells.ring(url, bells.API) == 1  # first sight of the job: a wake
                await asyncio.wait_for(event.wait(), LONG_POLL / 2)
                event.clear()
                state[job] = ("succeeded", 0)
                assert bells.ring(url, bells.API) == 1
                await asyncio.wait_for(event.wait(), LONG_POLL / 2)
        finally:
            await waiter.stop()
        assert waiter._bell is None and not list(bells.bells_dir(url).iterdir())

    asyncio.run(main())


def test_a_streamed_jobs_written_text_rings_the_api(tmp_path):
    """worker/progress.py rings the API's bells after each write of streamed text, so a streaming
    request reads the new pieces at once."""
    from structspec.db import migrate
    from structspec.db.session import make_session_factory
    from worker.progress import Pieces, ProgressWriter

    url = f"sqlite:///{tmp_path / 's.db'}"
    migrate.upgrade(url)
    api = bells.Bell.open(url, bells.API)
    try:
        pieces = Pieces()
        pieces(b'{"a": ')
        ProgressWriter().watch(make_session_factory(make_engine(url)), uuid.uuid4(), "token", pieces)
        assert api.wait(LONG_POLL)
    finally:
        api.close()
