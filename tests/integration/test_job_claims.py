"""The claim/store protocol that makes job tasks idempotent, on SQLite and PostgreSQL: a
result is stored only by the current lease holder of a still-running job."""

from __future__ import annotations

import time
import uuid

import pytest
import sqlalchemy as sa

from structspec.db.jobs import JobRepository
from structspec.db.repositories import SchemaRepository
from structspec.db.session import make_engine, make_session_factory


@pytest.fixture
def sessions(database_url):
    engine = make_engine(database_url)
    factory = make_session_factory(engine)
    with factory.begin() as s:
        schema = SchemaRepository(s).add(name=f"claims-{uuid.uuid4().hex[:8]}", version=1, body={}, hash_="h",
                                         description=None)
    factory.schema_id = schema.id
    yield factory
    with factory.begin() as s:
        from structspec.db.models import JobRecord, SchemaRecord

        s.query(JobRecord).filter(JobRecord.schema_id == schema.id).delete()
        s.query(SchemaRecord).filter(SchemaRecord.id == schema.id).delete()
    engine.dispose()


def new_job(sessions) -> uuid.UUID:
    with sessions.begin() as s:
        return JobRepository(s).add_many([dict(schema_id=sessions.schema_id, document="d", options={})])[0]


def test_a_job_is_claimed_once_and_stored_once(sessions):
    job = new_job(sessions)
    with sessions.begin() as s:
        assert JobRepository(s).claim([job], "w1", 60) == [job]
    with sessions.begin() as s:
        assert JobRepository(s).claim([job], "w2", 60) == []  # live lease: a duplicate message is a no-op
    with sessions.begin() as s:
        assert JobRepository(s).store(job, "w1", status="succeeded", result={"a": 1})
    with sessions.begin() as s:
        repo = JobRepository(s)
        assert repo.claim([job], "w3", 60) == [] and not repo.store(job, "w1", status="succeeded")
        assert (repo.get(job).completions, repo.get(job).attempts) == (1, 1)


def test_expired_lease_is_taken_over_and_the_old_holder_cannot_store(sessions):
    job = new_job(sessions)
    with sessions.begin() as s:
        JobRepository(s).claim([job], "dead", 0.01)
    time.sleep(0.05)
    with sessions.begin() as s:
        assert JobRepository(s).requeue_expired("reaper", max_attempts=3, lease_s=60) == ([job], [])
    with sessions.begin() as s:
        assert JobRepository(s).claim([job], "alive", 60) == [job]
    with sessions.begin() as s:
        assert not JobRepository(s).store(job, "dead", status="succeeded", result={})
        assert JobRepository(s).store(job, "alive", status="succeeded", result={})
    with sessions.begin() as s:
        rec = JobRepository(s).get(job)
        assert (rec.status, rec.completions, rec.attempts) == ("succeeded", 1, 2)


def test_a_running_job_cancelled_is_not_overwritten_by_its_worker(sessions):
    job = new_job(sessions)
    with sessions.begin() as s:
        JobRepository(s).claim([job], "w1", 60)
    with sessions.begin() as s:
        assert JobRepository(s).cancel(job)
    with sessions.begin() as s:
        repo = JobRepository(s)
        assert repo.held(job, "w1") is None
        assert not repo.store(job, "w1", status="succeeded", result={"a": 1})
        assert not repo.cancel(job)  # finished: nothing to cancel (the API answers 409)
    with sessions.begin() as s:
        rec = JobRepository(s).get(job)
        assert (rec.status, rec.result, rec.completions) == ("cancelled", None, 0)


def expire(sessions, job: uuid.UUID, token: str) -> None:
    """Claim `job` for `token` with a lease that has run out by the time this returns."""
    with sessions.begin() as s:
        assert JobRepository(s).claim([job], token, 0.01) == [job]
    time.sleep(0.05)


def test_a_job_whose_lease_ran_out_max_attempts_times_fails_naming_the_cause(sessions):
    job, neighbour = new_job(sessions), new_job(sessions)
    for n in (1, 2):
        expire(sessions, job, f"dead-{n}")
        with sessions.begin() as s:
            assert JobRepository(s).requeue_expired(f"reaper-{n}", max_attempts=3, lease_s=60) == ([job], [])
    expire(sessions, job, "dead-3")
    expire(sessions, neighbour, "dead-n")
    with sessions.begin() as s:  # expired: only the reaper takes it back (a redelivered message cannot)
        assert JobRepository(s).claim([job], "late", 60) == []
    with sessions.begin() as s:
        assert JobRepository(s).requeue_expired("reaper-3", max_attempts=3, lease_s=60) == ([neighbour], [job])
    with sessions.begin() as s:
        rec = JobRepository(s).get(job)
        assert (rec.status, rec.attempts, rec.completions) == ("failed", 3, 1)
        assert rec.error.startswith("the worker died 3 times while running this job") and "MAX_ATTEMPTS=3" in rec.error
        assert rec.finished_at is not None and rec.lease_until is None
        assert not JobRepository(s).store(job, "dead-3", status="succeeded", result={})  # too late to store


def test_a_later_attempt_is_claimed_only_by_a_message_of_its_own(sessions):
    retried, fresh = new_job(sessions), new_job(sessions)
    expire(sessions, retried, "dead")
    with sessions.begin() as s:
        assert JobRepository(s).requeue_expired("reaper", max_attempts=3, lease_s=60) == ([retried], [])
    with sessions.begin() as s:  # e.g. the dead worker's own message, redelivered
        assert JobRepository(s).claim([retried, fresh], "w1", 60) == [fresh]
    with sessions.begin() as s:
        repo = JobRepository(s)
        assert repo.claim([retried], "w2", 60) == [retried]
        assert repo.retried([retried, fresh]) == [retried]


def test_a_claim_retried_after_a_lost_reply_gets_its_jobs_back(sessions):
    """The first claim committed but its reply was lost: the same token claiming again gets
    the same jobs (one attempt), another token none."""
    job = new_job(sessions)
    with sessions.begin() as s:
        assert JobRepository(s).claim([job], "w1", 60) == [job]
    with sessions.begin() as s:
        assert JobRepository(s).claim([job], "w1", 60) == [job]
        assert JobRepository(s).claim([job], "w2", 60) == []
        assert JobRepository(s).get(job).attempts == 1


def test_stored_by_tells_a_lost_reply_from_a_lost_write(sessions):
    job = new_job(sessions)
    with sessions.begin() as s:
        JobRepository(s).claim([job], "w1", 60)
    with sessions.begin() as s:
        assert not JobRepository(s).stored_by(job, "w1")
        assert JobRepository(s).store(job, "w1", status="succeeded", result={"a": 1})
    with sessions.begin() as s:
        assert JobRepository(s).stored_by(job, "w1") and not JobRepository(s).stored_by(job, "w2")


def test_stranded_queued_jobs_are_taken_once_for_republishing_after_the_grace(sessions):
    old, fresh, running = new_job(sessions), new_job(sessions), new_job(sessions)
    with sessions.begin() as s:
        JobRepository(s).claim([running], "w1", 60)
    time.sleep(1.1)
    fresh = new_job(sessions)
    with sessions.begin() as s:
        first = JobRepository(s).claim_stranded("reaper-a", older_than_s=1)
    with sessions.begin() as s:
        second = JobRepository(s).claim_stranded("reaper-b", older_than_s=1)  # published just now: not stranded
    assert old in first[0] and first[1] == [] and fresh not in first[0] and running not in first[0], first
    assert second == ([], [])
    with sessions.begin() as s:
        assert JobRepository(s).get(old).status == "queued"  # only its publish time moved


def test_lease_times_come_from_the_database_clock_not_the_workers(postgres_url, monkeypatch):
    """A worker whose clock runs an hour ahead still writes leases on the database's time."""
    from datetime import datetime, timedelta, timezone

    from structspec.db import columns
    from structspec.db import migrate

    migrate.upgrade(postgres_url)
    engine = make_engine(postgres_url)
    factory = make_session_factory(engine)
    try:
        with factory.begin() as s:
            schema = SchemaRepository(s).add(name=f"clock-{uuid.uuid4().hex[:8]}", version=1, body={}, hash_="h",
                                             description=None)
            job = JobRepository(s).add_many([dict(schema_id=schema.id, document="d", options={})])[0]
        class Ahead(datetime):  # this process's clock, an hour fast
            @classmethod
            def now(cls, tz=None):
                return datetime.now(tz) + timedelta(hours=1)

        monkeypatch.setattr(columns, "datetime", Ahead)
        assert columns.utcnow() - datetime.now(timezone.utc) > timedelta(minutes=59)
        with factory.begin() as s:
            assert JobRepository(s).claim([job], "w1", 60) == [job]
            db_now = s.scalar(sa.select(sa.func.now()))
            rec = JobRepository(s).get(job)
            assert abs((rec.lease_until - db_now).total_seconds() - 60) < 5, (rec.lease_until, db_now)
            assert abs((rec.created_at - db_now).total_seconds()) < 5
    finally:
        with factory.begin() as s:
            s.execute(sa.text("DELETE FROM jobs WHERE id = :id"), {"id": job})
            s.execute(sa.text("DELETE FROM schemas WHERE id = :id"), {"id": schema.id})
        engine.dispose()


# --- reading a job's file (worker/ingest.py) ---------------------------------------------------

def new_file_job(sessions) -> uuid.UUID:
    with sessions.begin() as s:
        return JobRepository(s).add_many([dict(schema_id=sessions.schema_id, document="", options={}, phase="reading",
                                               source=b"%PDF-1.4 ...", intake={"media_type": "application/pdf"})])[0]


def test_a_job_whose_file_is_unread_is_left_to_the_readers_and_read_once(sessions):
    job = new_file_job(sessions)
    with sessions.begin() as s:
        assert JobRepository(s).claim([job], "model", 60) == []  # not the model's yet: its file is unread
    with sessions.begin() as s:
        assert JobRepository(s).claim_read(job, "r1", 60, max_attempts=3) == "claimed"
    with sessions.begin() as s:
        assert JobRepository(s).claim_read(job, "r2", 60, max_attempts=3) == "skip"  # a live reader holds it
    with sessions.begin() as s:
        assert not JobRepository(s).read_done(job, "r2", "text", None, None)  # not its holder: nothing stored
        assert JobRepository(s).read_done(job, "r1", "the text", b"layout", ["a warning"])
    with sessions.begin() as s:
        repo = JobRepository(s)
        row = repo.get(job)
        assert (row.status, row.phase, row.document, row.layout, row.source, row.warnings, row.lease_owner) == \
            ("queued", None, "the text", b"layout", None, ["a warning"], None)
        assert repo.claim_read(job, "r3", 60, max_attempts=3) == "skip"  # read already
        assert repo.claim([job], "model", 60) == [job]  # now the model's


def test_a_file_that_cannot_be_read_fails_its_job_and_a_cancelled_one_is_not_read(sessions):
    job, cancelled = new_file_job(sessions), new_file_job(sessions)
    with sessions.begin() as s:
        repo = JobRepository(s)
        assert repo.claim_read(job, "r1", 60, max_attempts=3) == "claimed"
        assert repo.cancel(cancelled)
        assert repo.claim_read(cancelled, "r1", 60, max_attempts=3) == "skip"
    with sessions.begin() as s:
        assert JobRepository(s).read_failed(job, "r1", "file_unreadable: the PDF cannot be read")
    with sessions.begin() as s:
        row = JobRepository(s).get(job)
        assert (row.status, row.error, row.source, row.completions) == \
            ("failed", "file_unreadable: the PDF cannot be read", None, 1)
        assert row.finished_at is not None


def test_a_file_whose_reader_died_is_published_again_and_fails_after_max_attempts(sessions):
    job = new_file_job(sessions)
    for attempt in range(1, 4):
        with sessions.begin() as s:
            assert JobRepository(s).claim_read(job, f"dies-{attempt}", 0.01, max_attempts=3) == "claimed"
        time.sleep(0.05)  # the lease of 0.01 s runs out: the reader died
        with sessions.begin() as s:
            repo = JobRepository(s)
            # the model's republishing leaves it alone; the readers' takes it (its first read is not new)
            assert repo.claim_stranded(f"reaper-m{attempt}", 0.0) == ([], [])
            assert repo.claim_stranded(f"reaper-r{attempt}", 0.0, reading=True) == ([], [job])
    with sessions.begin() as s:
        assert JobRepository(s).claim_read(job, "last", 60, max_attempts=3) == "exhausted"
        assert JobRepository(s).read_failed(job, "last", "read_crashed: ...")
    with sessions.begin() as s:
        assert JobRepository(s).get(job).status == "failed"


def test_a_file_being_read_is_not_published_again_while_its_reader_holds_it(sessions):
    job = new_file_job(sessions)
    with sessions.begin() as s:
        assert JobRepository(s).claim_stranded("reaper-1", 0.0, reading=True) == ([job], [])  # never read yet
    with sessions.begin() as s:
        assert JobRepository(s).claim_read(job, "r1", 60, max_attempts=3) == "claimed"
    with sessions.begin() as s:
        assert JobRepository(s).claim_stranded("reaper-2", 0.0, reading=True) == ([], [])
