"""What the service keeps of jobs and batches: listing them, deleting them through the API,
and the retention sweep (worker/retention.py), on SQLite and PostgreSQL. The jobs stay queued
here (no worker): deleting running ones is tested against a real worker in test_jobs.py."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
import sqlalchemy as sa

from integration_helpers import assert_error, id_param
from structspec.db.columns import utcnow
from structspec.db.models import OpenAIBatchRecord
from structspec.worker import retention
from structspec.worker.retention import Purged, purge_expired

SCHEMA = {"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}
# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}


@pytest.fixture
def schema_id(client) -> str:
    r = client.post("/v1/schemas", json={"name": "receipt", "schema": SCHEMA})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def submit(client, schema_id: str, document: str = "Total: 12.50") -> str:
    r = client.post("/v1/extractions", json={"schema_id": schema_id, "document": document})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def submit_batch(client, schema_id: str, n: int = 3) -> str:
    r = client.post("/v1/batches", json={"schema_id": schema_id,
                                         "documents": [{"document": f"Total: {i}"} for i in range(n)]})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def job_ids(sessions, batch_id: str | None = None) -> set[str]:
    with sessions() as s:
        q = "SELECT id FROM jobs" + (" WHERE batch_id = :b" if batch_id else "")
        rows = s.execute(sa.text(q), {"b": id_param(s, batch_id)} if batch_id else {}).scalars()
        return {str(uuid.UUID(str(r))) for r in rows}


def age(sessions, table: str, column: str, days: float, ids: list[str], status: str | None = None) -> None:
    """Move `column` of rows `ids` back by `days` (and set status, for jobs)."""
    with sessions.begin() as s:
        for i in ids:
            values = {column: utcnow() - timedelta(days=days)}
            if status:
                values["status"] = status
            table_obj = sa.table(table, sa.column("id"), *(sa.column(c) for c in values))
            s.execute(sa.update(table_obj).where(table_obj.c.id == id_param(s, i)).values(**values))


# --- GET /v1/extractions, GET /v1/batches --------------------------------------------------------

def test_jobs_list_newest_first_as_summaries_filtered_and_paged(client, sessions, schema_id):
    other = client.post("/v1/schemas", json={"name": "other", "schema": {"type": "object"}}).json()["id"]
    first, batch = submit(client, schema_id, "Total: 1 secret-doc"), submit_batch(client, schema_id)
    last = submit(client, other)
    age(sessions, "jobs", "finished_at", 0, [first], status="succeeded")

    page = client.get("/v1/extractions").json()
    assert (page["total"], page["limit"], page["offset"]) == (5, 50, 0)
    ids = [j["id"] for j in page["items"]]
    assert ids[0] == last and ids[-1] == first and set(ids[1:4]) == job_ids(sessions, batch)
    assert set(page["items"][0]) == {"id", "status", "phase", "schema_id", "batch_id", "error", "created_at",
                                     "finished_at"}
    assert "secret-doc" not in client.get("/v1/extractions").text  # no documents (or results) in a list

    def ids_of(query: str) -> list[str]:
        return [j["id"] for j in client.get(f"/v1/extractions?{query}").json()["items"]]

    assert ids_of("status=succeeded") == [first]
    assert set(ids_of(f"batch_id={batch}")) == job_ids(sessions, batch)
    assert ids_of(f"schema_id={other}") == [last]
    assert ids_of(f"schema_id={other}&status=succeeded") == []
    assert ids_of("limit=2") == ids[:2] and ids_of("limit=2&offset=4") == ids[4:]
    for query, param in (("status=done", "status"), ("batch_id=12", "batch_id"), ("limit=0", "limit"),
                         ("limit=501", "limit"), ("offset=-1", "offset")):
        assert assert_error(client.get(f"/v1/extractions?{query}"), 422)["errors"][0]["path"] == param


def test_batches_list_newest_first_with_counts_and_status(client, sessions, schema_id):
    old, new = submit_batch(client, schema_id, 2), submit_batch(client, schema_id, 3)
    age(sessions, "jobs", "finished_at", 0, sorted(job_ids(sessions, old)), status="succeeded")
    page = client.get("/v1/batches").json()
    assert page["total"] == 2 and [b["id"] for b in page["items"]] == [new, old]
    assert page["items"][0]["counts"]["queued"] == 3 and page["items"][0]["status"] == "queued"
    assert page["items"][1]["counts"]["succeeded"] == 2 and page["items"][1]["status"] == "succeeded"
    assert page["items"][1] == client.get(f"/v1/batches/{old}").json()  # the same record as a read
    assert [b["id"] for b in client.get("/v1/batches?limit=1&offset=1").json()["items"]] == [old]
    assert client.get(f"/v1/batches?schema_id={uuid.uuid4()}").json() == {"items": [], "total": 0, "limit": 50,
                                                                            "offset": 0}
    assert_error(client.get("/v1/batches?schema_id=x"), 422)


def test_metrics_count_the_backlog_and_the_age_of_its_oldest_job(client, sessions, schema_id):
    from prometheus_client.parser import text_string_to_metric_families

    client.app.state.metrics_cache.ttl_s = 0  # every scrape reads afresh (the cache: test_api_health.py)

    def gauges() -> dict[tuple[str, str], float]:
        return {(s.name, s.labels["status"]): s.value
                for family in text_string_to_metric_families(client.get("/metrics").text) for s in family.samples
                if s.name in ("structspec_jobs", "structspec_oldest_job_age_seconds")}

    assert gauges() == {("structspec_jobs", "queued"): 0, ("structspec_jobs", "running"): 0,
                        ("structspec_oldest_job_age_seconds", "queued"): 0,
                        ("structspec_oldest_job_age_seconds", "running"): 0}
    old, new, running, done = (submit(client, schema_id) for _ in range(4))
    age(sessions, "jobs", "created_at", 300 / 86400, [old])
    age(sessions, "jobs", "created_at", 60 / 86400, [running], status="running")
    age(sessions, "jobs", "finished_at", 0, [done], status="succeeded")
    g = gauges()
    assert (g[("structspec_jobs", "queued")], g[("structspec_jobs", "running")]) == (2, 1)
    assert 300 <= g[("structspec_oldest_job_age_seconds", "queued")] < 360
    assert 60 <= g[("structspec_oldest_job_age_seconds", "running")] < 120


# --- DELETE /v1/extractions/{id}, DELETE /v1/batches/{id} ------------------------------------

def test_deleting_a_job_removes_its_row_and_later_reads_are_404(client, sessions, schema_id):
    keep, job = submit(client, schema_id), submit(client, schema_id, "Total: 99.95")
    r = client.delete(f"/v1/extractions/{job}")
    assert r.status_code == 204, r.text
    assert r.content == b""
    assert job_ids(sessions) == {keep}
    assert "no extraction job" in assert_error(client.get(f"/v1/extractions/{job}"), 404)["detail"]
    assert_error(client.delete(f"/v1/extractions/{job}"), 404)  # twice: gone
    assert_error(client.post(f"/v1/extractions/{job}/cancel"), 404)
    assert_error(client.delete("/v1/extractions/not-a-uuid"), 404)
    assert client.get(f"/v1/extractions/{keep}").json()["status"] == "queued"


def test_a_job_of_a_batch_is_409_naming_the_batch_and_the_batch_deletes_with_all_its_jobs(client, sessions,
                                                                                              schema_id):
    alone, batch, other = submit(client, schema_id), submit_batch(client, schema_id), submit_batch(client, schema_id)
    member = sorted(job_ids(sessions, batch))[0]
    err = assert_error(client.delete(f"/v1/extractions/{member}"), 409)
    assert batch in err["detail"] and f"DELETE /v1/batches/{batch}" in err["detail"]
    assert len(job_ids(sessions, batch)) == 3

    r = client.delete(f"/v1/batches/{batch}")
    assert r.status_code == 204, r.text
    assert job_ids(sessions, batch) == set()
    assert_error(client.get(f"/v1/batches/{batch}"), 404)
    assert_error(client.get(f"/v1/batches/{batch}/results"), 404)
    assert_error(client.delete(f"/v1/batches/{batch}"), 404)
    assert job_ids(sessions) == {alone} | job_ids(sessions, other)  # nothing else went
    assert client.get(f"/v1/batches/{other}").json()["counts"]["queued"] == 3


def test_the_batch_behind_an_openai_format_batch_is_409(client, sessions, schema_id):
    batch = submit_batch(client, schema_id)
    with sessions.begin() as s:
        s.add(OpenAIBatchRecord(id="batch_" + uuid.uuid4().hex, batch_id=uuid.UUID(batch), input_file_id="file-x",
                                endpoint="/v1/chat/completions", completion_window="24h", status="in_progress",
                                total=3, invalid=[], created_at=utcnow()))
    err = assert_error(client.delete(f"/v1/batches/{batch}"), 409)
    assert "OpenAI-format batch batch_" in err["detail"]
    assert len(job_ids(sessions, batch)) == 3
    with sessions.begin() as s:
        s.execute(sa.delete(OpenAIBatchRecord))


# --- retention -----------------------------------------------------------------------------------

def test_retention_deletes_what_finished_before_the_cutoff_and_nothing_else(client, settings, sessions, schema_id):
    old_done, new_done, old_queued = (submit(client, schema_id) for _ in range(3))
    age(sessions, "jobs", "finished_at", 10, [old_done], status="succeeded")
    age(sessions, "jobs", "finished_at", 1, [new_done], status="failed")
    age(sessions, "jobs", "created_at", 10, [old_queued])  # old, but never finished

    old_batch, mixed_batch, new_batch = (submit_batch(client, schema_id) for _ in range(3))
    age(sessions, "batches", "created_at", 10, [old_batch, mixed_batch, new_batch])
    age(sessions, "jobs", "finished_at", 9, sorted(job_ids(sessions, old_batch)), status="cancelled")
    mixed = sorted(job_ids(sessions, mixed_batch))
    age(sessions, "jobs", "finished_at", 9, mixed[:2], status="succeeded")  # one still queued
    age(sessions, "jobs", "finished_at", 2, sorted(job_ids(sessions, new_batch)), status="succeeded")

    assert purge_expired(settings, sessions) == Purged()  # retention 0: keep everything
    assert len(job_ids(sessions)) == 12

    week = replace(settings, job_retention_days=7)
    assert purge_expired(week, sessions) == Purged(jobs=1, batches=1, more=False)
    assert old_done not in job_ids(sessions) and job_ids(sessions, old_batch) == set()
    assert_error(client.get(f"/v1/batches/{old_batch}"), 404)
    assert {new_done, old_queued} <= job_ids(sessions)
    assert len(job_ids(sessions, mixed_batch)) == 3 and len(job_ids(sessions, new_batch)) == 3
    assert purge_expired(week, sessions) == Purged()  # a second sweep finds nothing more

    # new_done, new_batch
    assert purge_expired(replace(settings, job_retention_days=1), sessions) == Purged(jobs=1, batches=1)
    assert job_ids(sessions) == {old_queued} | set(mixed)


def test_retention_deletes_old_openai_format_batches_with_their_jobs_and_old_files(client, settings, sessions,
                                                                                     schema_id):
    from structspec.db.models import FilePartRecord, FileRecord

    old, running, recent = (submit_batch(client, schema_id, 2) for _ in range(3))
    age(sessions, "batches", "created_at", 10, [old, running, recent])
    age(sessions, "jobs", "finished_at", 9, sorted(job_ids(sessions, old)), status="succeeded")
    age(sessions, "jobs", "finished_at", 9, sorted(job_ids(sessions, running))[:1], status="succeeded")
    age(sessions, "jobs", "finished_at", 1, sorted(job_ids(sessions, recent)), status="succeeded")
    with sessions.begin() as s:
        for name, batch, days in (("old", old, 10), ("running", running, 10), ("recent", recent, 10),
                                  ("invalid", None, 10), ("new", None, 0)):
            s.add(OpenAIBatchRecord(id=f"batch_{name}", batch_id=uuid.UUID(batch) if batch else None,
                                    input_file_id="file-x", endpoint="/v1/chat/completions", completion_window="24h",
                                    status="completed", total=2, invalid=[],
                                    created_at=utcnow() - timedelta(days=days)))
        for name, days in (("old", 8), ("new", 6)):
            s.add(FileRecord(id=f"file-{name}", purpose="batch", filename="in.jsonl", bytes=1,
                             created_at=utcnow() - timedelta(days=days)))
            s.flush()  # the file before its piece (no ORM relationship orders them)
            s.add(FilePartRecord(file_id=f"file-{name}", seq=0, data=b"x"))
    purged = purge_expired(replace(settings, job_retention_days=7), sessions)
    assert (purged.openai_batches, purged.files, purged.batches, purged.more) == (2, 1, 0, False)
    with sessions() as s:
        assert set(s.scalars(sa.select(OpenAIBatchRecord.id))) == {"batch_running", "batch_recent", "batch_new"}
        assert set(s.scalars(sa.select(FileRecord.id))) == {"file-new"}
        assert set(s.scalars(sa.select(FilePartRecord.file_id))) == {"file-new"}  # pieces go with their file
    assert job_ids(sessions, old) == set() and len(job_ids(sessions, running)) == 2
    assert len(job_ids(sessions, recent)) == 2
    with sessions.begin() as s:
        s.execute(sa.delete(OpenAIBatchRecord))
        s.execute(sa.delete(FileRecord))


def test_retention_sweeps_a_backlog_in_short_transactions_over_several_rounds(client, settings, sessions, schema_id,
                                                                                monkeypatch):
    monkeypatch.setattr(retention, "PURGE_CHUNK", 2)
    monkeypatch.setattr(retention, "BATCHES_PER_CHUNK", 1)
    monkeypatch.setattr(retention, "MAX_CHUNKS", 2)
    for _ in range(5):
        submit(client, schema_id)
    batches = [submit_batch(client, schema_id, 2) for _ in range(3)]
    age(sessions, "jobs", "finished_at", 3, sorted(job_ids(sessions)), status="succeeded")
    age(sessions, "batches", "created_at", 3, batches)
    two_days = replace(settings, job_retention_days=2)
    assert purge_expired(two_days, sessions) == Purged(jobs=4, batches=2, more=True)  # two transactions, rows left
    assert purge_expired(two_days, sessions) == Purged(jobs=1, batches=1, more=False)
    assert job_ids(sessions) == set() and client.get("/v1/batches").json()["total"] == 0


def test_a_workers_reaper_thread_sweeps_when_it_starts(client, settings, sessions, schema_id, monkeypatch):
    from structspec.worker import tasks

    monkeypatch.setattr(tasks, "reap", lambda *_: 0)  # the lease and republish rounds are tested elsewhere
    job = submit(client, schema_id)
    age(sessions, "jobs", "finished_at", 3, [job], status="succeeded")
    reaper = tasks.Reaper(replace(settings, job_retention_days=2))
    reaper.start()
    try:
        deadline = time.monotonic() + 10
        while job in job_ids(sessions) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        reaper.stop()
    assert job not in job_ids(sessions), "the reaper did not sweep within 10 s"


# --- Idempotency-Key ------------------------------------------------------------------------------

def key_count(sessions) -> int:
    with sessions() as s:
        return s.scalar(sa.text("SELECT count(*) FROM idempotency_keys"))


def test_a_submission_repeated_with_its_key_gets_the_first_answer_and_creates_nothing(client, sessions, schema_id):
    one = {"schema_id": schema_id, "document": "Total: 4.20"}
    first = client.post("/v1/extractions", json=one, headers={"idempotency-key": "job-1"})
    again = client.post("/v1/extractions", json=one, headers={"idempotency-key": "job-1"})
    assert first.status_code == again.status_code == 202
    assert "idempotent-replayed" not in first.headers and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json() and job_ids(sessions) == {first.json()["id"]}
    other = client.post("/v1/extractions", json=one, headers={"idempotency-key": "job-2"})
    plain = client.post("/v1/extractions", json=one)
    assert len({first.json()["id"], other.json()["id"], plain.json()["id"]}) == 3  # new key, no key: new jobs

    docs = {"schema_id": schema_id, "documents": [{"document": "a"}, {"document": 7}]}
    b1 = client.post("/v1/batches", json=docs, headers={"idempotency-key": "batch-1"})
    b2 = client.post("/v1/batches", json=docs, headers={"idempotency-key": "batch-1"})
    assert b1.status_code == b2.status_code == 202 and b2.headers["idempotent-replayed"] == "true"
    assert b2.json() == b1.json() and b1.json()["rejected"][0]["line"] == 2  # the same answer, rejections too
    ndjson = {"idempotency-key": "batch-2", "content-type": "application/x-ndjson"}
    n1 = client.post(f"/v1/batches?schema_id={schema_id}&max_tokens=64", content=b'{"document": "x"}\n',
                     headers=ndjson)
    n2 = client.post(f"/v1/batches?schema_id={schema_id}&max_tokens=64", content=b'{"document": "x"}\n',
                     headers=ndjson)
    assert n1.status_code == 202 and n2.json() == n1.json() and n2.headers["idempotent-replayed"] == "true"
    assert client.get("/v1/batches").json()["total"] == 2 and len(job_ids(sessions)) == 3 + 1 + 1
    assert key_count(sessions) == 4


def test_the_same_key_with_another_request_is_422_naming_the_header(client, sessions, schema_id):
    body = {"schema_id": schema_id, "document": "Total: 1"}
    assert client.post("/v1/extractions", json=body, headers={"idempotency-key": "k"}).status_code == 202
    cases = [("/v1/extractions", {"json": {**body, "document": "Total: 2"}}),
             ("/v1/extractions", {"json": {**body, "options": {"max_tokens": 10}}}),
             ("/v1/batches", {"json": {"schema_id": schema_id, "documents": [{"document": "Total: 1"}]}})]
    for path, request in cases:
        err = assert_error(client.post(path, headers={"idempotency-key": "k"}, **request), 422)
        assert err["errors"] == [{"path": "Idempotency-Key", "keyword": None, "message": "reused with a different "
                                  "request", "source": "header"}]
        assert "'k' was used in the last 24 hours for a different request" in err["detail"]
    for bad in ("", "x" * 256):
        err = assert_error(client.post("/v1/extractions", json=body, headers={"idempotency-key": bad}), 422)
        assert err["errors"][0]["path"] == "Idempotency-Key" and err["errors"][0]["source"] == "header"
    assert len(job_ids(sessions)) == 1


def test_a_key_is_per_tenant_and_forgotten_after_a_day(client, settings, sessions, schema_id):
    from structspec.services.keys import create_key

    body = {"schema_id": schema_id, "document": "Total: 1"}
    first = client.post("/v1/extractions", json=body, headers={"idempotency-key": "daily"}).json()["id"]
    with sessions.begin() as s:
        s.execute(sa.text("UPDATE idempotency_keys SET created_at = :t"), {"t": utcnow() - timedelta(hours=25)})
    later = client.post("/v1/extractions", json=body, headers={"idempotency-key": "daily"})
    assert later.status_code == 202 and "idempotent-replayed" not in later.headers
    assert later.json()["id"] != first and key_count(sessions) == 1  # the old key was replaced

    with sessions.begin() as s:  # a day-old key is swept by the workers whatever the retention
        s.execute(sa.text("UPDATE idempotency_keys SET created_at = :t"), {"t": utcnow() - timedelta(hours=25)})
    assert purge_expired(settings, sessions) == Purged() and key_count(sessions) == 0

    _, alice = create_key(client.app.state.session_factory, "a", "alice")
    _, bob = create_key(client.app.state.session_factory, "b", "bob")
    ids = []
    for key in (alice, bob):
        auth = {"authorization": f"Bearer {key}", "idempotency-key": "shared"}
        sid = client.post("/v1/schemas", headers=auth, json={"name": "r", "schema": SCHEMA}).json()["id"]
        r = client.post("/v1/extractions", headers=auth, json={"schema_id": sid, "document": "d"})
        assert r.status_code == 202 and "idempotent-replayed" not in r.headers, r.text
        ids.append(r.json()["id"])
    assert ids[0] != ids[1]


def test_concurrent_first_submissions_with_one_key_store_one_job_and_answer_alike(client, sessions, schema_id):
    from concurrent.futures import ThreadPoolExecutor

    from structspec.api.services.jobs import Idempotency, JobService
    from structspec.api.structs import ExtractionCreate

    state = client.app.state
    data = ExtractionCreate(schema_id=schema_id, document="Total: 3")
    idem = Idempotency.of("race", "POST /v1/extractions", b"same request")
    barrier = __import__("threading").Barrier(4)

    def submit_one(_):
        service = JobService(state.session_factory, state.settings, state.publisher)
        barrier.wait()
        return service.submit(data, idem)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(submit_one, range(4)))
    assert len({a.id for a, _ in answers}) == 1 and len(job_ids(sessions)) == 1
    assert sorted(replayed for _, replayed in answers) == [False, True, True, True]
