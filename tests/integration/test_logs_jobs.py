"""Job lifecycle logs carry job_id and schema_id, and never a document.

The API runs in-process (TestClient) and the worker's task runs in-process too, on a tiny
random-weight Llama, so caplog sees every record both sides emit: submitted, started,
finished, failed, crashed, cancelled, re-queued by the reaper. Each document carries a
marker string that must not appear in any record, however it is formatted."""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace

import pytest
import sqlalchemy as sa

from jobs_helpers import TINY_SCHEMA, build_tiny_model
from structspec.config import Settings
from structspec.db.jobs import JobRepository
from structspec.db.session import make_engine, make_session_factory
from structspec.logs import JsonFormatter, TextFormatter, fields_of

MARKER = "QUOKKA-7f3a9-MARKER"
# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}
# The marker sits past the preview length, as a document's tail would.
DOCUMENT = "label: b, ok: yes. " + "filler words of a private document " * 6 + MARKER


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama-logs")))


@pytest.fixture
def worker_here(settings, tiny_model, monkeypatch):
    """worker.tasks with the test's database and the tiny model, in this process."""
    from structspec.worker import tasks

    process = tasks._Process()
    monkeypatch.setattr(tasks, "PROCESS", process)
    monkeypatch.setattr(tasks.app, "structspec_settings", replace(settings, model=tiny_model, torch_threads=1))
    yield tasks
    if process._loop is not None:
        process._loop.stop()


@pytest.fixture
def sessions(settings):
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    with engine.begin() as conn:  # jobs do not cascade; the settings fixture deletes the schemas
        conn.execute(sa.text("DELETE FROM jobs"))
    engine.dispose()


def submit(client, schema_id: str, **options) -> str:
    r = client.post("/v1/extractions", json={"schema_id": schema_id, "document": DOCUMENT, "options": options})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def records(caplog, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(message)]


def test_lifecycle_records_carry_job_and_schema_ids_and_no_document(client, sessions, worker_here, caplog,
                                                                    monkeypatch):
    tasks = worker_here
    caplog.set_level(logging.INFO)
    sid = client.post("/v1/schemas", json={"name": "logs", "schema": TINY_SCHEMA}).json()["id"]

    ok = submit(client, sid, strategy="schema", draft_len=4)
    truncated = submit(client, sid, strategy="schema", draft_len=4, max_tokens=1)
    cancelled = submit(client, sid)
    assert client.post(f"/v1/extractions/{cancelled}/cancel").status_code == 200
    assert tasks.run_jobs([ok, truncated, cancelled]) == {"claimed": 2, "stored": 2}
    assert client.get(f"/v1/extractions/{ok}").json()["status"] == "succeeded"
    assert client.get(f"/v1/extractions/{truncated}").json()["status"] == "failed"

    crashed = submit(client, sid, strategy="schema", draft_len=4)

    def crash(*_args, **_kw):  # a library error that quotes its input, the marker in its first words
        raise RuntimeError(f"cannot handle {MARKER!r} in {DOCUMENT!r}")

    monkeypatch.setattr(tasks.PROCESS.loop(tasks.app.structspec_settings).engine, "submit", crash)
    assert tasks.run_jobs([crashed]) == {"claimed": 1, "stored": 1}

    orphan = submit(client, sid)  # claimed by a worker that died: its lease has run out
    with sessions.begin() as s:
        assert JobRepository(s).claim([uuid.UUID(orphan)], "dead-worker", -1) == [uuid.UUID(orphan)]
    published = []
    monkeypatch.setattr(tasks, "enqueue", lambda _app, ids, chunk_size=None: published.extend(ids))
    assert tasks.reap(tasks.app.structspec_settings, sessions) == 1 and published == [uuid.UUID(orphan)]

    def one(message: str, job_id: str, **expected) -> logging.LogRecord:
        [rec] = [r for r in records(caplog, message) if getattr(r, "job_id", None) == job_id]
        assert rec.schema_id == sid, (message, fields_of(rec))
        for k, v in expected.items():
            assert getattr(rec, k) == v, (message, k, fields_of(rec))
        return rec

    for job in (ok, truncated, cancelled, crashed, orphan):
        one("job submitted", job, document_chars=len(DOCUMENT))
    for job in (ok, truncated, crashed):
        one("job started", job, attempt=1)
    finished = one("job finished", ok, status="succeeded", strategy="schema", draft_len=4)
    assert finished.duration_s > 0 and finished.output_tokens > 0 and finished.decode_s >= 0
    assert "truncated" in one("job failed", truncated, status="failed").error
    one("job failed", crashed, status="failed")
    one("extraction crashed", crashed)
    one("job cancelled", cancelled, status="cancelled")
    one("job re-queued", orphan)
    claimed = records(caplog, "claimed 2 of 3 job(s)")[0]
    assert claimed.job_ids == [ok, truncated] and claimed.skipped_ids == [cancelled]

    # The crash's error (stored on the job) quotes the document; the log lines give its structural
    # prefix, length and digest only.
    assert MARKER in client.get(f"/v1/extractions/{crashed}").json()["error"]
    assert caplog.records
    json_fmt, text_fmt = JsonFormatter(), TextFormatter()
    for rec in caplog.records:
        for rendered in (json_fmt.format(rec), text_fmt.format(rec), repr(vars(rec))):
            assert MARKER not in rendered, rendered


def test_worker_process_in_json_mode_writes_only_json_lines_with_ids_and_no_document(tmp_path, tiny_model):
    """A real `structspec worker` subprocess (embedded stack) with STRUCTSPEC_LOG_FORMAT=json."""
    import json

    from litestar.testing import TestClient

    from jobs_helpers import Worker, poll
    from structspec.api.app import create_app
    from structspec.db import migrate

    settings = Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache", log_format="json")
    migrate.upgrade(settings.database_url)
    worker = Worker(settings, tiny_model, tmp_path / "worker.log").start()
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            sid = client.post("/v1/schemas", json={"name": "logs", "schema": TINY_SCHEMA}).json()["id"]
            job_id = submit(client, sid, strategy="schema", draft_len=4)
            poll(lambda: client.get(f"/v1/extractions/{job_id}").json()["finished_at"], timeout=90,
                 what="the job", worker=worker)
            poll(lambda: "job finished" in worker.log.read_text(), timeout=10, what="the log line", worker=worker)
            # the file reader (`--queues all`) starts beside the model's worker and may be ready after the
            # job: SIGTERM before its handlers are installed would end it without its shutdown notice
            poll(lambda: worker.log.read_text().count(' ready."') >= 2, timeout=60, what="the file reader ready",
                 worker=worker)
    finally:
        worker.stop()
    text = worker.log.read_text()
    assert MARKER not in text and DOCUMENT[:40] not in text
    # Every line is JSON except Celery's shutdown notice, which it prints on stdout itself: for the
    # model's worker process and for the file reader it started (`--queues all`), which gets SIGTERM
    # from the process group and again from its parent's exit, so once or twice
    raw = [line for line in text.splitlines() if line.strip()]
    notices = [line for line in raw if not line.startswith("{")]
    assert set(notices) == {"worker: Warm shutdown (MainProcess)"} and 2 <= len(notices) <= 3, notices
    lines = [json.loads(line) for line in raw if line.startswith("{")]
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    mine = [line for line in lines if line.get("job_id") == job_id]
    assert [m["message"] for m in mine] == ["job started", "job finished"], mine
    assert all(m["schema_id"] == sid for m in mine) and mine[1]["status"] == "succeeded"
    assert any(line["logger"] == "celery.apps.worker" for line in lines)  # Celery's own lines are JSON too
