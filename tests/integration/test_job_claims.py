"""The claim/store protocol that makes job tasks idempotent, on SQLite and PostgreSQL: a
result is stored only by the current lease holder of a still-running job."""

from __future__ import annotations

import time
import uuid

import pytest

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
        assert JobRepository(s).requeue_expired("reaper") == [job]
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
