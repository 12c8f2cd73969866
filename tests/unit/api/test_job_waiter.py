"""The job waiter (api/services/waiting.py) without a server: who is woken, deadlines, client
disconnects, and the polling fallback while PostgreSQL's listener is down."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import anyio

from structspec.api.services import waiting
from structspec.api.services.waiting import JobWaiter, unless_disconnected
from structspec.db.session import make_engine


def sqlite_waiter(tmp_path) -> JobWaiter:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    return JobWaiter(make_engine(url), url)


def test_a_wake_sets_only_the_events_of_that_job(tmp_path):
    async def main():
        waiter = sqlite_waiter(tmp_path)
        a, b = uuid.uuid4(), uuid.uuid4()
        with waiter.subscribe(a) as ea, waiter.subscribe(a) as ea2, waiter.subscribe(b) as eb:
            waiter.wake(a)
            assert ea.is_set() and ea2.is_set() and not eb.is_set()
        assert waiter._waiters == {}  # unsubscribed on leaving

    asyncio.run(main())


def test_changes_reads_again_when_woken_and_stops_at_the_deadline(tmp_path):
    async def main():
        waiter = sqlite_waiter(tmp_path)
        job = uuid.uuid4()
        reads = []
        start = time.monotonic()

        async def wake_twice():
            for _ in range(2):
                await asyncio.sleep(0.1)
                waiter.wake(job)

        asyncio.get_running_loop().create_task(wake_twice())
        async with contextlib.aclosing(waiter.changes(job, lambda: len(reads), start + 0.6)) as changes:
            async for n in changes:
                reads.append((n, time.monotonic() - start))
        # the first read, one per wake (well before SAFETY_S), and the last at the deadline
        assert [n for n, _ in reads] == [0, 1, 2, 3]
        assert reads[1][1] < 0.3 and reads[2][1] < 0.4 and 0.6 <= reads[3][1] < 0.6 + 0.5

    asyncio.run(main())


def test_a_disconnecting_client_stops_the_work_and_a_finished_one_returns_its_value():
    async def main():
        messages = asyncio.Queue()

        async def receive():
            return await messages.get()

        async def forever():
            await asyncio.sleep(3600)

        async def quick():
            return "done"

        asyncio.get_running_loop().call_later(0.1, messages.put_nowait, {"type": "http.disconnect"})
        with anyio.fail_after(5):
            assert await unless_disconnected(receive, forever) == (None, True)
            assert await unless_disconnected(receive, quick) == ("done", False)

    asyncio.run(main())


def test_sqlite_poller_wakes_a_waiter_whose_job_row_changes(tmp_path, monkeypatch):
    import sqlalchemy as sa

    from structspec.db import migrate
    from structspec.db.models import JobRecord, SchemaRecord
    from structspec.db.columns import utcnow

    url = f"sqlite:///{tmp_path / 'w.db'}"
    migrate.upgrade(url)
    engine = make_engine(url)
    job = uuid.uuid4()
    with engine.begin() as conn:  # a job row needs a schema row
        conn.execute(sa.insert(SchemaRecord).values(id=job, tenant="default", name="s", version=1, body={},
                                                    hash="h", created_at=utcnow()))
        conn.execute(sa.insert(JobRecord).values(id=job, tenant="default", schema_id=job, status="queued",
                                                 document="d", options={}, attempts=0, completions=0,
                                                 created_at=utcnow()))
    monkeypatch.setattr(waiting, "SAFETY_S", 30.0)  # only the poller can wake it in time

    async def main():
        waiter = JobWaiter(engine, url)
        await waiter.start()
        try:
            with waiter.subscribe(job) as event:
                await asyncio.sleep(3 * waiting.POLL_S)  # the poller has seen the row as it is
                event.clear()
                await anyio.to_thread.run_sync(lambda: _finish(engine, job))
                with anyio.fail_after(2):
                    await event.wait()
        finally:
            await waiter.stop()

    asyncio.run(main())


def _finish(engine, job):
    import sqlalchemy as sa

    from structspec.db.models import JobRecord

    with engine.begin() as conn:
        conn.execute(sa.update(JobRecord).where(JobRecord.id == job).values(status="succeeded"))


def test_while_the_postgres_listener_is_down_waiters_poll_often():
    async def main():
        url = "postgresql://nobody@127.0.0.1:1/nothing"  # a closed port: LISTEN never starts
        waiter = JobWaiter(make_engine(url), url)
        assert waiter.postgres
        await waiter.start()
        try:
            await asyncio.sleep(0.3)
            assert not waiter.listening and waiter.interval() == waiting.POLL_S
        finally:
            await waiter.stop()

    asyncio.run(main())
