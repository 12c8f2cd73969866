"""Doorbells between processes sharing a SQLite file (structspec/db/bells.py): a ring wakes the
bells of its role, a gone bell is cleared, other databases have none; the API's job waiter
reads at once when rung, and every write that ends a job, grows its streamed output or deletes
it rings once committed, whoever makes it (the embedded broker's poll:
tests/unit/test_broker_poll.py). The poll is set to 30 s here, so a ring that did not wake it
would show as a wait of that length."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from structspec.api.services import waiting
from structspec.api.services.waiting import JobWaiter
from structspec.db import bells, migrate
from structspec.db.jobs import BatchRepository, JobRepository
from structspec.db.repositories import SchemaRepository
from structspec.db.session import make_engine, make_session_factory

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
    monkeypatch.setattr(waiting, "SQLITE_RUNG_POLL_S", LONG_POLL)
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
    from structspec.worker.progress import Pieces, ProgressWriter

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


def test_the_progress_writer_sleeps_while_no_streamed_job_runs_and_wakes_for_the_next(tmp_path, monkeypatch):
    """Its thread wakes every FLUSH_EVERY_S while a streamed job runs, not at all while none does
    (it used to wake forever once used, taking the core from the engine), and a new job wakes it."""
    import threading
    from types import SimpleNamespace

    from structspec.worker import progress

    url = f"sqlite:///{tmp_path / 's.db'}"
    migrate.upgrade(url)
    sessions = make_session_factory(make_engine(url))
    wakes: list[int] = []  # the thread of each wake (other tests' writers may still run in this process)
    sleep = time.sleep
    monkeypatch.setattr(progress, "time", SimpleNamespace(sleep=lambda s: (wakes.append(threading.get_ident()),
                                                                           sleep(s))))

    def ours() -> int:
        return sum(ident == thread.ident for ident in wakes)

    def woken(more_than: int) -> bool:
        deadline = time.monotonic() + 10
        while ours() <= more_than and time.monotonic() < deadline:
            sleep(0.01)
        return ours() > more_than

    writer, first = progress.ProgressWriter(), uuid.uuid4()
    before = set(threading.enumerate())
    writer.watch(sessions, first, "token", progress.Pieces())
    [thread] = [t for t in set(threading.enumerate()) - before if t.name == "progress-writer"]
    assert woken(2)  # rounds while the job runs
    writer.forget(first)
    sleep(3 * progress.FLUSH_EVERY_S)  # the round under way ends
    idle = ours()
    sleep(10 * progress.FLUSH_EVERY_S)
    assert ours() == idle, "the writer woke with no streamed job to write"
    writer.watch(sessions, uuid.uuid4(), "token", progress.Pieces())
    assert woken(idle)


@pytest.fixture
def job_store(tmp_path):
    """A migrated SQLite job store, a schema in it, and the API's bell beside it."""
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    migrate.upgrade(url)
    sessions = make_session_factory(make_engine(url))
    with sessions.begin() as s:
        sessions.schema_id = SchemaRepository(s).add(name="rings", version=1, body={}, hash_="h",
                                                     description=None).id
    api = bells.Bell.open(url, bells.API)
    yield sessions, api
    api.close()


def held_job_in_batch(sessions, lease_s: float = 60) -> tuple[uuid.UUID, uuid.UUID]:
    """A batch of one job, claimed by the token "w" (job id, batch id)."""
    with sessions.begin() as s:
        batch = BatchRepository(s).add(tenant="default", schema_id=sessions.schema_id, total=1, options={})
        repo = JobRepository(s)
        job = repo.add_many([dict(schema_id=sessions.schema_id, document="d", options={}, batch_id=batch.id,
                                  position=1)])[0]
        assert repo.claim([job], "w", lease_s) == [job]
        repo.mark_started(job, "w")
        return job, batch.id


WRITES = {
    "stored": lambda s, job, batch: JobRepository(s).store(job, "w", status="succeeded", result={}),
    "cancelled": lambda s, job, batch: JobRepository(s).cancel(job),
    "its batch cancelled": lambda s, job, batch: JobRepository(s).cancel_unfinished_in_batch(batch),
    "streamed text written": lambda s, job, batch: JobRepository(s).write_partial(job, "w", ["{"]),
    "deleted": lambda s, job, batch: JobRepository(s).delete_many([job]),
    "its batch deleted": lambda s, job, batch: BatchRepository(s).delete(batch),
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_the_waiters_want_rings_the_api_once_committed(job_store, write):
    sessions, api = job_store
    job, batch = held_job_in_batch(sessions)
    assert not api.wait(0)  # queueing, claiming and starting a job ring nothing
    with sessions.begin() as s:
        WRITES[write](s, job, batch)
        s.flush()
        assert not api.wait(0)  # not before the commit: a woken waiter must read the committed row
    assert api.wait(LONG_POLL)


def test_the_reaper_failing_a_job_rings_and_a_rolled_back_write_does_not(job_store):
    sessions, api = job_store
    job, _ = held_job_in_batch(sessions, lease_s=0.01)
    with pytest.raises(RuntimeError):
        with sessions.begin() as s:
            JobRepository(s).cancel(job)
            raise RuntimeError("rolled back")
    assert not api.wait(0.2)
    time.sleep(0.05)
    with sessions.begin() as s:
        assert JobRepository(s).requeue_expired("reaper", max_attempts=1, lease_s=0.01) == ([], [job])
    assert api.wait(LONG_POLL)
