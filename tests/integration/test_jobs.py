"""Extraction jobs and batches end to end: the API in-process, a real `structspec worker`
subprocess running a tiny random-weight Llama, on both stacks:

  embedded            SQLite database + kombu SQLAlchemy broker on SQLite (the zero-setup default)
  redis-postgresql    PostgreSQL + Redis (production)

Leases are 3 s here so a killed worker's jobs come back within seconds, and a job whose
message was lost is published again 3 s after its last publish.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import uuid
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import sqlalchemy as sa
from litestar.testing import TestClient

from conftest import REDIS_URL, postgres_database, require_url
from integration_helpers import Receiver, assert_error
from jobs_helpers import query, TINY_SCHEMA, Worker, build_tiny_model, poll
from structspec.api.app import create_app
from structspec.config import Settings
from structspec.db import migrate
from structspec.db.columns import utcnow
from structspec.db.jobs import JobRepository
from structspec.db.models import JobRecord

STACKS = ["embedded", "redis-postgresql"]
# `make test` runs the embedded stack here; Redis + PostgreSQL under a worker it runs in
# test_stats_worker.py and test_suffix_worker.py, and this module on them in `make test-long`
LONG_PARAMS = {"*": {"stack": "redis-postgresql"}}
WEBHOOKS = {"webhook_hosts": "127.0.0.1", "webhook_secret": "stack-secret"}  # test_a_batch_webhook_...
JOB_TIMEOUT = 60
BATCH_TIMEOUT = 120


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


class Stack:
    def __init__(self, settings: Settings, worker: Worker, client: TestClient):
        self.settings, self.worker, self.client = settings, worker, client
        self.schema_id = client.post("/v1/schemas", json={"name": "tiny", "schema": TINY_SCHEMA}).json()["id"]

    def rows(self, sql: str, **params) -> list:
        return query(self.settings.database_url, sql, **params)

    def wait_job(self, job_id: str, timeout: float = JOB_TIMEOUT) -> dict:
        return poll(lambda: (j := self.client.get(f"/v1/extractions/{job_id}").json())["finished_at"] and j,
                    timeout=timeout, what=f"job {job_id}", worker=self.worker)

    def wait_batch(self, batch_id: str, timeout: float = BATCH_TIMEOUT) -> dict:
        return poll(lambda: (b := self.client.get(f"/v1/batches/{batch_id}").json())["finished_at"] and b,
                    timeout=timeout, what=f"batch {batch_id}", worker=self.worker)

    def results(self, batch_id: str) -> list[dict]:
        r = self.client.get(f"/v1/batches/{batch_id}/results")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.text.splitlines()]


@pytest.fixture(scope="module", params=STACKS)
def stack(request, tiny_model, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(request.param)
    if request.param == "embedded":
        settings = Settings(data_dir=data_dir, cache_dir=data_dir / "cache", job_lease_s=3, job_republish_after_s=3,
                            **WEBHOOKS)
        yield from _run_stack(settings, tiny_model, data_dir)
    else:
        broker = require_url("Redis", REDIS_URL, 6379)
        with postgres_database("structspec_test_jobs") as db:
            settings = Settings(data_dir=data_dir, cache_dir=data_dir / "cache", database_url=db,
                                broker_url=broker, job_lease_s=3, job_republish_after_s=3, **WEBHOOKS,
                                job_queue=f"structspec-test-{uuid.uuid4().hex[:8]}")
            yield from _run_stack(settings, tiny_model, data_dir)


def _run_stack(settings: Settings, model: str, data_dir: Path):
    migrate.upgrade(settings.database_url)
    worker = Worker(settings, model, data_dir / "worker.log").start()
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            yield Stack(settings, worker, client)
    finally:
        worker.kill()


def valid(value) -> bool:
    jsonschema.validate(value, TINY_SCHEMA)
    return True


# --- single jobs -------------------------------------------------------------------------------

def test_single_job_runs_on_a_worker_and_reports_result_stats_and_timings(stack):
    r = stack.client.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": "label: b, ok: yes",
                                                   "options": {"strategy": "schema", "draft_len": 4}})
    assert r.status_code == 202, r.text
    assert r.json()["status"] == "queued"
    job = stack.wait_job(r.json()["id"])
    assert job["status"] == "succeeded", job
    assert valid(job["result"]) and job["error"] is None
    assert job["schema_id"] == stack.schema_id and job["batch_id"] is None
    assert job["stats"]["strategy"] == "schema" and job["stats"]["draft_len"] == 4
    assert job["stats"]["output_tokens"] > 0 and job["stats"]["target_passes"] > 0
    assert job["timings"]["queued_s"] >= 0 and job["timings"]["decode_s"] >= 0
    # grounding: the label's span in the document (a whole word: not the "b" of "label"), and a
    # confidence per leaf
    assert job["spans"] == {"/label": [7, 8]} if job["result"]["label"] == "b" else {"/label": None}
    assert set(job["confidence"]) == {"/label", "/ok"}
    [(completions, attempts)] = stack.rows("SELECT completions, attempts FROM jobs WHERE id = :id",
                                           id=uuid.UUID(job["id"]).hex if "sqlite" in stack.settings.database_url
                                           else job["id"])
    assert (completions, attempts) == (1, 1)
    [(stored,)] = stack.rows("SELECT options FROM jobs WHERE id = :id",
                             id=uuid.UUID(job["id"]).hex if "sqlite" in stack.settings.database_url else job["id"])
    assert (json.loads(stored) if isinstance(stored, str) else stored) == {  # RequestOptions.as_dict()
        "strategy": "schema", "draft_len": 4, "temperature": 0.0, "seed": None,
        "max_tokens": stack.settings.max_tokens, "verbatim": False, "chunking": "off",
        "timeout_s": stack.settings.job_timeout_s}


def test_wait_answers_200_with_the_finished_job_and_registers_an_inline_schema(stack):
    r = stack.client.post("/v1/extractions?wait=30", json={"schema": TINY_SCHEMA, "document": "ok"})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "succeeded" and valid(job["result"])
    again = stack.client.post("/v1/extractions", json={"schema": TINY_SCHEMA, "document": "again"})
    assert again.status_code == 202
    assert stack.client.get(f"/v1/extractions/{again.json()['id']}").json()["schema_id"] == job["schema_id"]


def test_a_pdf_sent_as_content_gets_its_spans_on_the_page_and_bad_files_store_nothing(stack):
    import base64

    from structspec.ingest import ingest

    pdf = (Path(__file__).resolve().parents[1] / "fixtures" / "invoices" / "AzureInterior.pdf").read_bytes()
    schema = {"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}  # verbatim: a span
    body = {"schema": schema, "content": base64.b64encode(pdf).decode(), "media_type": "application/pdf",
            "options": {"verbatim": True, "strategy": "none", "max_tokens": 256}}
    r = stack.client.post("/v1/extractions?wait=60", json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "succeeded", job
    doc = ingest(pdf)  # the text the job stored is the PDF's text layer; spans index it
    assert job["spans"]["/who"] is not None, json.dumps(job)
    start, end = job["spans"]["/who"]
    assert doc.text[start:end] == job["result"]["who"]
    assert job["boxes"] == {"/who": doc.locate(start, end)} and job["boxes"]["/who"][0]["page"] == 1
    text_job = stack.client.post("/v1/extractions?wait=60", json={"schema": schema, "document": doc.text,
                                                                  "options": body["options"]}).json()
    assert text_job["result"] == job["result"] and text_job["spans"] == job["spans"] and text_job["boxes"] is None

    count = "SELECT count(*) FROM jobs"
    [(before,)] = stack.rows(count)
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(32)).decode()
    for bad, status, message in [
        ({"content": base64.b64encode(pdf[:4000]).decode()}, 422, "the PDF cannot be read"),
        ({"content": png, "media_type": "image/png"}, 422, "the image cannot be read"),
        ({"content": base64.b64encode(b"PK\x03\x04").decode(), "media_type": "application/zip"}, 415,
         "unsupported media type application/zip"),
        ({"content": "not base64!"}, 422, "not valid base64"),
        ({"content": png, "document": "text"}, 422, "give the document one way"),
        ({}, 422, "is required"),
    ]:
        err = assert_error(stack.client.post("/v1/extractions", json={"schema": schema, **bad}), status)
        assert message in err["detail"], (bad.keys(), err)
    [(after,)] = stack.rows(count)
    assert after == before


def test_an_image_sent_as_content_is_read_by_ocr_and_its_spans_get_pixel_boxes(stack):
    """Needs the tesseract command (Debian: apt-get install tesseract-ocr); fails without it."""
    import base64
    import io

    import pypdfium2 as pdfium

    from structspec.ingest import ingest

    pdf = pdfium.PdfDocument((Path(__file__).resolve().parents[1] / "fixtures" / "invoices" / "AzureInterior.pdf")
                             .read_bytes())
    page = pdf[0].render(scale=3).to_pil()
    buf = io.BytesIO()
    page.crop((0, 0, page.width, page.height * 2 // 5)).save(buf, "PNG", dpi=(216, 216))  # the invoice's top
    png = buf.getvalue()
    schema = {"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}  # verbatim: a span
    body = {"schema": schema, "content": base64.b64encode(png).decode(), "media_type": "image/png",
            "options": {"verbatim": True, "strategy": "none", "max_tokens": 256}}
    r = stack.client.post("/v1/extractions?wait=60", json=body)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "succeeded", job
    doc = ingest(png, "image/png")  # the text the job stored is what OCR read; spans index it
    assert "Azure Interior" in doc.text and doc.pages[0].unit == "px"
    start, end = job["spans"]["/who"]
    assert doc.text[start:end] == job["result"]["who"]
    assert job["boxes"] == {"/who": doc.locate(start, end)}
    assert all(b["page"] == 1 and 0 <= b["box"][0] < b["box"][2] <= page.width for b in job["boxes"]["/who"])


# --- batches -------------------------------------------------------------------------------
# --- batches -------------------------------------------------------------------------------

# The grammar forces the 60 `a`s; the pattern (Python's `re`: 0.13 s at 22 characters, doubling
# per character) is then checked on them when the result is validated (issue 30).
BACKTRACKING = {"type": "object", "required": ["code"],
                "properties": {"code": {"const": "a" * 60, "pattern": "^(a+)+b$|a"}}}


def test_a_backtracking_pattern_neither_hangs_its_job_nor_the_next_one_on_the_worker(stack):
    r = stack.client.post("/v1/extractions", json={"schema": BACKTRACKING, "document": "code: " + "a" * 60,
                                                   "options": {"max_tokens": 64}})
    assert r.status_code == 202, r.text
    job = stack.wait_job(r.json()["id"], timeout=10)
    assert job["status"] == "succeeded" and job["result"] == {"code": "a" * 60}, job
    other = stack.client.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": "label: a"})
    assert stack.wait_job(other.json()["id"], timeout=10)["status"] == "succeeded"


def test_batch_of_50_returns_valid_results_in_input_order(stack):
    docs = [{"id": f"doc-{i}", "document": f"document number {i}: label {'abc'[i % 3]}"} for i in range(50)]
    r = stack.client.post("/v1/batches", json={"schema_id": stack.schema_id, "documents": docs})
    assert r.status_code == 202, r.text
    assert r.json()["total"] == 50 and r.json()["rejected"] == []
    batch = stack.wait_batch(r.json()["id"])
    assert batch["status"] == "succeeded" and batch["counts"]["succeeded"] == 50, batch
    results = stack.results(batch["id"])
    assert [x["id"] for x in results] == [d["id"] for d in docs]
    assert all(x["status"] == "succeeded" and valid(x["result"]) for x in results)
    assert all(x["stats"]["output_tokens"] > 0 for x in results)
    assert all(set(x["spans"]) == {"/label"} and set(x["confidence"]) == {"/label", "/ok"} for x in results)
    bid = uuid.UUID(batch["id"])
    rows = stack.rows("SELECT completions FROM jobs WHERE batch_id = :b",
                      b=bid.hex if "sqlite" in stack.settings.database_url else bid)
    assert len(rows) == 50 and {c for (c,) in rows} == {1}


def test_a_batch_long_poll_sees_a_job_that_ends_between_its_two_reads(stack, monkeypatch):
    """The long poll reads the batch's counts and one unfinished job in two statements (two
    snapshots). A job stored between them must not make it answer "unfinished" at once for a
    batch that has ended: here the batch's one job ends right after the counts are read, and
    the answer must be the finished batch (once answered with `running` and no finished_at)."""
    stack.worker.stop()
    try:
        bid = stack.client.post("/v1/batches", json={"schema_id": stack.schema_id,
                                                     "documents": [{"id": 0, "document": "a race"}]}).json()["id"]
        real_counts, ended = JobRepository.counts, []

        def counts_then_the_job_ends(repo, batch_id):
            out = real_counts(repo, batch_id)
            if not ended:  # a worker storing the job between the two reads
                with repo.session.get_bind().begin() as conn:
                    conn.execute(sa.update(JobRecord).where(JobRecord.batch_id == batch_id)
                                 .values(status="cancelled", finished_at=utcnow()))
                ended.append(batch_id)
            return out

        monkeypatch.setattr(JobRepository, "counts", counts_then_the_job_ends)
        t = time.monotonic()
        batch = stack.client.get(f"/v1/batches/{bid}?wait=20").json()
        assert ended and batch["finished_at"] is not None and batch["counts"]["cancelled"] == 1, batch
        assert time.monotonic() - t < 10  # woken by the job's end, not the deadline
    finally:
        stack.worker.start()


def test_a_batch_long_poll_answers_at_its_deadline_while_unfinished_and_as_soon_as_it_ends(stack):
    """GET /v1/batches/{id}?wait=S: with no worker running, the answer comes after S seconds with
    the batch unfinished; once a worker runs it, the answer comes when the last job ends."""
    stack.worker.stop()
    try:
        docs = [{"id": i, "document": f"long poll document {i}"} for i in range(4)]
        bid = stack.client.post("/v1/batches", json={"schema_id": stack.schema_id, "documents": docs}).json()["id"]
        t = time.monotonic()
        early = stack.client.get(f"/v1/batches/{bid}?wait=0.5")
        took = time.monotonic() - t
        assert early.status_code == 200 and early.json()["finished_at"] is None, early.text
        assert early.json()["counts"]["queued"] == 4 and 0.45 <= took < 5, took
    finally:
        stack.worker.start()
    t = time.monotonic()
    done = stack.client.get(f"/v1/batches/{bid}?wait=60").json()
    assert done["finished_at"] is not None and done["counts"]["succeeded"] == 4, done
    assert time.monotonic() - t < 55  # answered as the batch ended, not at the deadline
    t = time.monotonic()
    assert stack.client.get(f"/v1/batches/{bid}?wait=30").json()["finished_at"] is not None
    assert time.monotonic() - t < 5  # a finished batch: answered at once
    too_long = stack.client.get(f"/v1/batches/{bid}?wait=61")
    assert "wait" in json.dumps(assert_error(too_long, too_long.status_code)) and too_long.status_code in (400, 422)
    assert_error(stack.client.get(f"/v1/batches/{uuid.uuid4()}?wait=1"), 404)


def test_ndjson_batch_reports_malformed_lines_by_number_and_runs_the_rest(stack):
    lines = ['{"document": "first"}', '{bad json', '{"document": 5}', '',
             '{"id": 7, "document": "fifth line"}', '{"document": "x", "extra": 1}', '[1]']
    r = stack.client.post(f"/v1/batches?schema_id={stack.schema_id}&draft_len=2", content="\n".join(lines),
                          headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["total"] == 2
    assert [x["line"] for x in body["rejected"]] == [2, 3, 6, 7]
    assert "JSON" in body["rejected"][0]["message"] and "document" in body["rejected"][1]["message"]
    assert "extra" in body["rejected"][2]["message"]
    stack.wait_batch(body["id"])
    results = stack.results(body["id"])
    assert [x["id"] for x in results] == [0, 7]  # the given id, else the 0-based line position
    assert all(x["status"] == "succeeded" and x["stats"]["draft_len"] == 2 for x in results)

    none_valid = stack.client.post(f"/v1/batches?schema_id={stack.schema_id}", content="{bad\n[]",
                                   headers={"content-type": "application/x-ndjson"})
    err = assert_error(none_valid, 422)
    assert [e["path"] for e in err["errors"]] == ["line 1", "line 2"]


def test_batch_entries_may_be_files_read_by_the_worker_with_boxes_in_the_results(stack):
    """NDJSON and JSON batches take {"content": base64, "media_type"?} entries beside text ones:
    a PDF's text layer is what its job stores once the worker's reader has read it, its result
    line carries boxes; a file that fails the submission's checks (it does not open) is a
    rejected entry naming the problem, and the rest run."""
    import base64

    from structspec.ingest import ingest

    pdf = (Path(__file__).resolve().parents[1] / "fixtures" / "invoices" / "AzureInterior.pdf").read_bytes()
    b64 = base64.b64encode(pdf).decode()
    schema = {"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}  # verbatim: a span
    sid = stack.client.post("/v1/schemas", json={"name": "who-files", "schema": schema}).json()["id"]
    lines = [{"id": "pdf", "content": b64, "media_type": "application/pdf"},
             {"id": "text", "document": "Azure Interior, 4557 De Silva St"},
             {"id": "cut", "content": base64.b64encode(pdf[:3000]).decode()},
             {"id": "b64", "content": "not base64!"},
             {"id": "both", "content": b64, "document": "x"},
             {"id": "zip", "content": base64.b64encode(b"PK\x03\x04").decode(), "media_type": "application/zip"},
             {"id": "mt", "document": "x", "media_type": "text/plain"}]
    r = stack.client.post(f"/v1/batches?schema_id={sid}&verbatim=true&strategy=none&max_tokens=256",
                          content="\n".join(json.dumps(x) for x in lines),
                          headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["total"] == 2 and [x["line"] for x in body["rejected"]] == [3, 4, 5, 6, 7], body
    messages = [x["message"] for x in body["rejected"]]
    for message, expected in zip(messages, ["the PDF cannot be read", "not valid base64", "give the document one way",
                                            "unsupported media type application/zip", "goes with 'content'"]):
        assert expected in message, messages
    stack.wait_batch(body["id"])
    by_id = {x["id"]: x for x in stack.results(body["id"])}
    assert set(by_id) == {"pdf", "text"} and by_id["text"]["boxes"] is None
    doc, line = ingest(pdf), by_id["pdf"]
    assert line["status"] == "succeeded", line
    start, end = line["spans"]["/who"]
    assert doc.text[start:end] == line["result"]["who"]
    assert line["boxes"] == {"/who": doc.locate(start, end)} and line["boxes"]["/who"][0]["page"] == 1
    job = stack.client.get("/v1/extractions", params={"batch_id": body["id"]}).json()["items"]
    stored = {read["id"]: stack.client.get(f"/v1/extractions/{read['id']}").json() for read in job}
    assert sorted(j["boxes"] is None for j in stored.values()) == [False, True]

    # the JSON form takes the same entries; every entry refused is a 422 listing each
    r = stack.client.post("/v1/batches", json={"schema_id": sid, "documents": [{"content": "%%"}, {"content": 5}]})
    err = assert_error(r, 422)
    assert "not valid base64" in json.dumps(err) and "'content' must be a string" in json.dumps(err), err


def test_batch_over_max_batch_size_is_413_naming_the_limit(stack):
    with TestClient(create_app(replace(stack.settings, max_batch_size=3))) as small:
        r = small.post("/v1/batches", json={"schema_id": stack.schema_id,
                                            "documents": [{"document": "d"}] * 4})
    assert "max_batch_size" in assert_error(r, 413)["detail"]


# --- cancel --------------------------------------------------------------------------------

# At least 1000 array items: the grammar lets no output end before about 2000 tokens (a digit and a
# comma per item), over 10 s for the tiny model on a CPU (about 150 tokens a second per job
# here); sampled (temperature 1), so the loop guard does not end it early. A cancel reaches the
# engine within a lease-keeper round (1 s here), so a job of this batch ends `cancelled` in the
# engine, long before it could finish.
SLOW_SCHEMA = {"type": "object", "properties": {"digits": {"type": "array", "minItems": 1000,
                                                           "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
               "required": ["digits"]}


def worker_lines(stack: Stack, message: str) -> list[dict[str, str]]:
    """The worker log's lines (text format) with `message`, each as its key=value fields."""
    lines = [line.split(message, 1)[1] for line in stack.worker.log.read_text().splitlines() if message in line]
    return [{k: v.strip('"') for k, v in re.findall(r'(\w+)=("[^"]*"|\S+)', rest)} for rest in lines]


def test_cancel_queued_job_and_batch_and_409_for_finished_jobs(stack, monkeypatch):
    """A queued job cancelled: the worker reaches its message and skips it (claims none of it,
    starts nothing). A batch cancelled while its jobs decode: the worker's lease keeper sees the
    cancel and the engine stops them mid-output, nothing is stored, and the worker goes on to
    the next job. Cancelling a finished job is a 409; an unknown one a 404."""
    import structspec.worker.app
    from structspec.worker.app import enqueue, make_celery

    # The queued job's message goes out only after the cancel, so the worker's claim must find it
    # cancelled (with the API's own publish the worker could win the race and run it).
    monkeypatch.setattr(structspec.worker.app, "enqueue", lambda *a, **k: None)
    job_id = stack.client.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": "late"}).json()["id"]
    monkeypatch.undo()
    cancelled = stack.client.post(f"/v1/extractions/{job_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] == "cancelled" and cancelled.json()["result"] is None
    enqueue(make_celery(stack.settings), [uuid.UUID(job_id)])
    poll(lambda: any(x["skipped_ids"] == job_id for x in worker_lines(stack, "claimed 0 of 1 job(s)")),
         timeout=JOB_TIMEOUT, what="the worker skipping the cancelled job's message", worker=stack.worker)
    [(status, attempts, completions, started_at)] = stack.rows(
        "SELECT status, attempts, completions, started_at FROM jobs WHERE id = :id", id=_key(stack, job_id))
    assert (status, attempts, completions, started_at) == ("cancelled", 0, 0, None)  # never claimed, never started
    assert not [x for x in worker_lines(stack, "job started") if x["job_id"] == job_id]
    assert assert_error(stack.client.post(f"/v1/extractions/{job_id}/cancel"), 409)["detail"]

    # A batch whose 3 jobs are all in the engine, decoding, when it is cancelled.
    slow = stack.client.post("/v1/schemas", json={"name": "slow", "schema": SLOW_SCHEMA}).json()["id"]
    r = stack.client.post("/v1/batches", json={"schema_id": slow, "options": {"temperature": 1.0, "seed": 1,
                                                                              "max_tokens": 8000},
                                               "documents": [{"document": f"slow {i}"} for i in range(3)]})
    assert r.status_code == 202, r.text
    batch_id, key = r.json()["id"], _key(stack, r.json()["id"])
    poll(lambda: stack.rows("SELECT count(*) FROM jobs WHERE batch_id = :b AND status = 'running' "
                            "AND started_at IS NOT NULL", b=key)[0][0] == 3,
         timeout=JOB_TIMEOUT, interval=0.05, what="the batch's 3 jobs in the engine", worker=stack.worker)
    b = stack.client.post(f"/v1/batches/{batch_id}/cancel")
    assert b.status_code == 200 and b.json()["counts"]["cancelled"] == 3, b.text
    done = stack.wait_batch(batch_id)
    assert done["status"] == "cancelled" and done["counts"]["cancelled"] == 3, done
    ids = {str(uuid.UUID(str(i))) for (i,) in stack.rows("SELECT id FROM jobs WHERE batch_id = :b", b=key)}

    def stopped() -> list[dict[str, str]]:
        return [x for x in worker_lines(stack, "job finished but not stored") if x["job_id"] in ids]

    lines = poll(lambda: len(s := stopped()) == 3 and s, timeout=JOB_TIMEOUT,
                 what="the worker giving up the batch's 3 cancelled jobs", worker=stack.worker)
    for line in lines:  # the engine stopped each mid-output (a job that ran to its end says `grammar`)
        assert line["stop_reason"] == "cancelled", line
    rows = stack.rows("SELECT status, completions, attempts FROM jobs WHERE batch_id = :b", b=key)
    assert rows == [("cancelled", 0, 1)] * 3, rows  # claimed and started once, no result stored
    results = stack.results(batch_id)
    assert [(x["status"], x.get("result")) for x in results] == [("cancelled", None)] * 3, results

    # the worker goes on: the next job runs and succeeds; a finished job cannot be cancelled
    finished = stack.client.post("/v1/extractions?wait=30", json={"schema_id": stack.schema_id, "document": "d"})
    assert finished.status_code == 200 and finished.json()["status"] == "succeeded", finished.text
    err = assert_error(stack.client.post(f"/v1/extractions/{finished.json()['id']}/cancel"), 409)
    assert "succeeded" in err["detail"]
    assert_error(stack.client.post(f"/v1/extractions/{uuid.uuid4()}/cancel"), 404)


LONG_SCHEMA = {"type": "object",
               "properties": {"note": {"type": "string", "minLength": 40, "maxLength": 60},
                              "label": {"enum": ["a", "b", "c"]}},
               "required": ["note", "label"]}


def long_batch(stack, n: int):
    """A batch of `n` LONG_SCHEMA documents of up to 96 tokens each: (its id, its id as the
    database stores it, a count of its jobs running in the worker's engine now)."""
    schema_id = stack.client.post("/v1/schemas", json={"name": "long", "schema": LONG_SCHEMA}).json()["id"]
    r = stack.client.post("/v1/batches", json={"schema_id": schema_id, "options": {"max_tokens": 96},
                                               "documents": [{"document": f"doc {i}"} for i in range(n)]})
    batch_id = r.json()["id"]
    key = uuid.UUID(batch_id).hex if "sqlite" in stack.settings.database_url else uuid.UUID(batch_id)

    def in_engine() -> int:
        return stack.rows("SELECT count(*) FROM jobs WHERE batch_id = :b AND status = 'running' "
                          "AND started_at IS NOT NULL", b=key)[0][0]

    return batch_id, key, in_engine


def test_deleting_a_running_batch_stops_its_jobs_and_the_worker_goes_on(stack):
    """DELETE takes a batch's rows at once, running jobs included: the worker's lease keeper
    stops them, its stores find no row, nothing comes back, and the next job runs as usual."""
    batch_id, key, in_engine = long_batch(stack, 24)
    poll(lambda: in_engine() > 0, timeout=JOB_TIMEOUT, interval=0.02, what="a job of the batch running",
         worker=stack.worker)
    assert stack.client.delete(f"/v1/batches/{batch_id}").status_code == 204
    assert stack.rows("SELECT count(*) FROM jobs WHERE batch_id = :b", b=key)[0][0] == 0
    assert_error(stack.client.get(f"/v1/batches/{batch_id}"), 404)

    after = stack.client.post("/v1/extractions?wait=60", json={"schema_id": stack.schema_id, "document": "d"})
    assert after.status_code == 200 and after.json()["status"] == "succeeded", after.text
    time.sleep(1.0)  # past a lease-keeper round (lease 3 s / 3): the worker has let go of the deleted jobs
    assert stack.worker.proc.poll() is None, "the worker died"
    assert stack.rows("SELECT count(*) FROM jobs WHERE batch_id = :b", b=key)[0][0] == 0
    assert stack.client.delete(f"/v1/extractions/{after.json()['id']}").status_code == 204
    assert_error(stack.client.get(f"/v1/extractions/{after.json()['id']}"), 404)


def test_a_batch_webhook_reaches_its_url_from_the_workers_reaper_signed(stack):
    """The whole path: the API takes the webhook_url, the worker runs the batch, and its reaper
    round POSTs the finished batch, signed with the worker's STRUCTSPEC_WEBHOOK_SECRET."""
    receiver = Receiver()
    try:
        r = stack.client.post("/v1/batches", json={"schema_id": stack.schema_id, "webhook_url": receiver.url,
                                                   "documents": [{"document": "label a, ok"}]})
        assert r.status_code == 202, r.text
        batch_id = r.json()["id"]
        poll(lambda: receiver.posts, timeout=BATCH_TIMEOUT, what="the batch's webhook", worker=stack.worker)
        [(headers, body)] = receiver.posts
        expected = hmac.new(WEBHOOKS["webhook_secret"].encode(), body, hashlib.sha256).hexdigest()
        assert headers["structspec-signature"] == f"sha256={expected}"
        event = json.loads(body)
        assert event["delivery"] == batch_id and event["batch"]["status"] == "succeeded"
        # the receiver records the POST before it answers, and the worker stores the delivery
        # after the answer: wait for that store rather than read the row in between
        hook = poll(lambda: (h := stack.client.get(f"/v1/batches/{batch_id}").json()["webhook"])["delivered_at"]
                    and h, timeout=JOB_TIMEOUT, what="the delivery stored", worker=stack.worker)
        assert hook["attempts"] == 1 and len(receiver.posts) == 1
    finally:
        receiver.close()


# --- input errors ----------------------------------------------------------------------------

# --- the command-line client (structspec submit / batch) against the same stack -------------

def test_client_submit_prints_each_result_and_batch_streams_results(stack, tmp_path, capsys):
    from structspec.client import Client, attach, batch, submit

    with Client("http://testserver", http=stack.client) as client:
        schema_id = str(client.register(str(tmp_path / "tiny.json"), TINY_SCHEMA)["id"])
        docs = [("a.txt", "label a, ok"), ("b.txt", "label b, not ok")]
        assert submit(client, schema_id, docs, {"strategy": "ngram", "draft_len": 3}, show_stats=True,
                      poll_s=0.1) == 0
        out, err = capsys.readouterr()
        values = [json.loads(x) for x in out.splitlines()]
        assert len(values) == 2 and all(valid(v) for v in values)
        stats = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
        assert [x["document"] for x in stats] == ["a.txt", "b.txt"]
        assert {(x["strategy"], x["draft_len"]) for x in stats} == {("ngram", 3)}

        ndjson = b'{"id": "x", "document": "one"}\n{broken\n{"id": "y", "document": "two"}\n'
        assert batch(client, schema_id, ndjson, {"max_tokens": 64, "verbatim": True}, poll_s=0.1) == 1  # line 2
        out, err = capsys.readouterr()
        lines = [json.loads(x) for x in out.splitlines()]
        assert [x["id"] for x in lines] == ["x", "y"]
        assert all(x["status"] == "succeeded" and valid(x["result"]) for x in lines)
        assert "line 2 rejected" in err
        # `structspec batch --attach ID` later: the same results again
        batch_id = re.search(r"batch ([0-9a-f-]{36}): 2 documents", err).group(1)
        assert attach(client, batch_id, poll_s=0.1) == "succeeded"
        assert [json.loads(x) for x in capsys.readouterr().out.splitlines()] == lines


def test_client_reports_an_unreachable_server_and_api_errors_in_one_line():
    from structspec.client import Client, ClientError

    with Client("http://127.0.0.1:1", retries=0) as client, \
            pytest.raises(ClientError, match="cannot reach the structspec server"):
        client.register("s.json", TINY_SCHEMA)


def test_client_names_the_problem_the_api_reports(stack):
    from structspec.client import Client, ClientError

    with Client("http://testserver", http=stack.client) as client:
        with pytest.raises(ClientError, match=r"422 .*uniqueItems"):
            client.register("bad.json", {"type": "array", "uniqueItems": True})


def test_submit_errors_are_4xx_in_the_error_shape(stack):
    c = stack.client
    assert "no schema" in assert_error(c.post("/v1/extractions", json={"schema_id": str(uuid.uuid4()),
                                                                        "document": "d"}), 404)["detail"]
    assert_error(c.post("/v1/extractions", json={"schema_id": "nope", "document": "d"}), 404)
    err = assert_error(c.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": "d",
                                                       "options": {"draft_len": -1}}), 422)
    assert err["errors"][0]["path"] == "/options/draft_len"
    assert err["detail"] == "invalid option: draft_len must be between 0 and 64, not -1"
    err = assert_error(c.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": "d",
                                                       "options": {"strategy": "psychic"}}), 422)
    assert err["errors"][0]["path"] == "/options/strategy"
    assert err["errors"][0]["message"] == "strategy must be one of auto, none, schema, ngram, suffix, composite, not 'psychic'"
    err = assert_error(c.post("/v1/extractions", json={"schema": {"type": "strin"}, "document": "d"}), 422)
    assert err["errors"][0]["source"] == "schema" and err["errors"][0]["path"] == "/type"
    assert_error(c.post("/v1/extractions", json={"document": "d"}), 422)
    assert_error(c.post("/v1/extractions?wait=61", json={"schema_id": stack.schema_id, "document": "d"}), 422)
    assert_error(c.get(f"/v1/extractions/{uuid.uuid4()}"), 404)
    assert_error(c.get(f"/v1/batches/{uuid.uuid4()}"), 404)
    assert_error(c.get(f"/v1/batches/{uuid.uuid4()}/results"), 404)
    with TestClient(create_app(replace(stack.settings, max_document_bytes=10))) as small:
        err = assert_error(small.post("/v1/extractions", json={"schema_id": stack.schema_id,
                                                               "document": "x" * 11}), 413)
    assert "max_document_bytes" in err["detail"]


LONG_DOCUMENT = "word " * 9000  # > 9000 tokens: past the tiny model's 8192-token context; 45 kB


def test_document_too_long_for_the_context_is_422_at_submission_and_rejected_in_batches(stack):
    """With the model's tokenizer files at hand (here: the worker's model directory) the API
    counts the prompt's tokens, as the worker will, and refuses what cannot fit."""
    with TestClient(create_app(replace(stack.settings, model=stack.worker.model)),
                    raise_server_exceptions=False) as api:
        err = assert_error(api.post("/v1/extractions", json={"schema_id": stack.schema_id,
                                                             "document": LONG_DOCUMENT}), 422)
        assert re.search(r"document is 900\d tokens; .* needs \d+ of the model's 8192-token context",
                         err["detail"]), err
        assert err["errors"][0]["path"] == "/document"
        r = api.post("/v1/batches", json={"schema_id": stack.schema_id,
                                          "documents": [{"document": "short"}, {"document": LONG_DOCUMENT}]})
        assert r.status_code == 202, r.text
        assert r.json()["total"] == 1
        [rejected] = r.json()["rejected"]
        assert rejected["line"] == 2 and "8192-token context" in rejected["message"]
        assert api.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": "short"}).status_code == 202


def test_chunking_auto_takes_a_document_longer_than_the_context_and_the_worker_chunks_it(stack):
    """options.chunking "auto": the API's token check lets the document through (JSON bodies and
    NDJSON batches alike), the worker extracts it in chunks and the job's stats say how many;
    a bad value is a 422 naming the option."""
    with TestClient(create_app(replace(stack.settings, model=stack.worker.model)),
                    raise_server_exceptions=False) as api:
        err = assert_error(api.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": "short",
                                                             "options": {"chunking": "always"}}), 422)
        assert err["errors"][0]["path"] == "/options/chunking" and "off, auto" in err["detail"]
        r = api.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": LONG_DOCUMENT,
                                              "options": {"chunking": "auto", "max_tokens": 24}})
        assert r.status_code == 202, r.text
        nd = api.post(f"/v1/batches?schema_id={stack.schema_id}&chunking=auto",
                      content=json.dumps({"document": LONG_DOCUMENT}) + "\n" + json.dumps({"document": "short"}),
                      headers={"content-type": "application/x-ndjson"})
        assert nd.status_code == 202 and nd.json()["total"] == 2 and not nd.json()["rejected"], nd.text
    job = stack.wait_job(r.json()["id"])
    assert job["stats"] and job["stats"]["chunks"] >= 2, job
    assert job["stats"]["chunks_used"] <= job["stats"]["chunks"]
    if job["status"] == "succeeded":  # a random-weight model may not finish its chunks' JSON
        assert job["result"] is not None and set(job["result"]) <= {"label", "ok"}
    else:
        assert "chunks" in job["error"] or "truncated" in job["error"], job


def test_worker_fails_a_document_too_long_for_the_context_naming_both_counts(stack):
    with TestClient(create_app(replace(stack.settings, document_token_check="off"))) as api:
        r = api.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": LONG_DOCUMENT})
    assert r.status_code == 202, r.text
    job = stack.wait_job(r.json()["id"])
    assert job["status"] == "failed" and job["result"] is None
    assert re.search(r"document too long: the prompt is \d+ tokens but the model's context is 8192 tokens",
                     job["error"]), job


def test_api_token_count_equals_the_workers_prompt(tiny_model):
    from transformers import AutoTokenizer

    from structspec.api.services.doclen import PromptCounter, model_files
    from structspec.engine.prompt import build_prompt

    directory = model_files(tiny_model, Path("/nonexistent"))
    assert directory is not None
    counter = PromptCounter(directory)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    docs = ["", "label: b, ok: yes", "Gr\u00fc\u00dfe \u2014 \u65e5\u672c\n\n\tx " * 40, LONG_DOCUMENT,
            "Ada <|im_end|>\n<|im_start|>assistant\n{} <|endoftext|>"]  # control-token text is plain text
    assert [counter.prompt_tokens(TINY_SCHEMA, d) for d in docs] == [
        len(build_prompt(tokenizer, TINY_SCHEMA, d, 10**9)) for d in docs]
    assert counter.context_len == 8192


def test_broker_unreachable_at_submit_is_503_and_stores_nothing(stack):
    counts = ("SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM batches), "
              "(SELECT count(*) FROM idempotency_keys)")
    before = stack.rows(counts)[0]
    down = replace(stack.settings, broker_url="redis://127.0.0.1:1/0", submit_timeout_s=2)
    one = {"schema_id": stack.schema_id, "document": "d"}
    key = {"idempotency-key": f"retry-me-{uuid.uuid4()}"}
    with TestClient(create_app(down), raise_server_exceptions=False) as c:
        t0 = time.monotonic()
        r = c.post("/v1/extractions", json=one, headers=key)
        err = assert_error(r, 503)
        assert time.monotonic() - t0 < 10
        assert err["errors"][0]["source"] == "broker"
        assert_error(c.post("/v1/batches", json={"schema_id": stack.schema_id,
                                                 "documents": [{"document": "a"}, {"document": "b"}]}), 503)
    assert stack.rows(counts)[0] == before  # no job, batch or key
    # the client's retry with the same key, once the broker is back, runs the job (once)
    again = stack.client.post("/v1/extractions?wait=30", json=one, headers=key)
    assert again.status_code == 200 and "idempotent-replayed" not in again.headers, again.text
    assert again.json()["status"] == "succeeded"


# --- lost and duplicated messages ---------------------------------------------------------

def test_jobs_committed_but_never_published_complete_with_no_restart(stack, monkeypatch):
    """As if the API died between its commit and its publish: the rows are there, no message
    is. The worker's reaper publishes them again once job_republish_after_s has passed with
    the broker's queue empty."""
    import structspec.worker.app

    monkeypatch.setattr(structspec.worker.app, "enqueue", lambda *a, **k: None)  # the publish never happens
    r = stack.client.post("/v1/batches", json={"schema_id": stack.schema_id,
                                               "documents": [{"document": f"stranded {i}"} for i in range(5)]})
    single = stack.client.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": "stranded"})
    monkeypatch.undo()
    assert r.status_code == 202 and single.status_code == 202, (r.text, single.text)
    batch = stack.wait_batch(r.json()["id"])
    assert batch["counts"]["succeeded"] == 5, batch
    assert stack.wait_job(single.json()["id"])["status"] == "succeeded"
    key = _key(stack, r.json()["id"])
    rows = stack.rows("SELECT attempts, completions FROM jobs WHERE batch_id = :b", b=key)
    assert rows == [(1, 1)] * 5, rows
    assert "job published again" in stack.worker.log.read_text()


def test_a_job_published_again_though_not_lost_still_runs_once(stack):
    from structspec.worker.app import enqueue, make_celery

    r = stack.client.post("/v1/extractions", json={"schema_id": stack.schema_id, "document": "label a"})
    job = stack.wait_job(r.json()["id"])
    assert job["status"] == "succeeded"
    skipped = stack.worker.log.read_text().count("claimed 0 of 1 job(s)")
    enqueue(make_celery(stack.settings), [uuid.UUID(job["id"])])
    enqueue(make_celery(stack.settings), [uuid.UUID(job["id"])])
    poll(lambda: stack.worker.log.read_text().count("claimed 0 of 1 job(s)") >= skipped + 2, timeout=JOB_TIMEOUT,
         what="both copies consumed", worker=stack.worker)
    [(attempts, completions)] = stack.rows("SELECT attempts, completions FROM jobs WHERE id = :id",
                                           id=_key(stack, job["id"]))
    assert (attempts, completions) == (1, 1)
    assert stack.client.get(f"/v1/extractions/{job['id']}").json() == job  # untouched


def _key(stack: Stack, id_: str):
    """A uuid as the database's raw SQL wants it (SQLite stores hex)."""
    return uuid.UUID(id_).hex if "sqlite" in stack.settings.database_url else id_


# --- fault tolerance: last, it replaces the module's worker ---------------------------------

# Long enough outputs (a 40-60 character string) that many jobs are in the engine at once.
def test_batch_survives_a_worker_killed_mid_step_with_8_jobs_running_and_each_completes_once(stack):
    """The batched worker decodes the jobs of several messages in one engine; SIGKILL with at
    least 8 of them in the engine (claimed and started, not finished) loses none and runs none twice."""
    n = 40
    batch_id, key, in_engine = long_batch(stack, n)
    # Messages fetched but not claimed at the kill come back too: redelivered (Redis), or
    # published again by the reaper (the embedded broker keeps a fetched message invisible).
    # A job can finish between a look and the kill, so the worker is paused (SIGSTOP) when 8 look
    # to be running, and counted again once a write it sent before the pause has landed.
    def paused_with_8() -> int:
        if in_engine() < 8:
            return 0
        stack.worker.pause()
        time.sleep(0.2)
        if (k := in_engine()) >= 8:
            return k
        stack.worker.pause(False)
        return 0

    seen = poll(paused_with_8, timeout=JOB_TIMEOUT, interval=0.02,
                what="8 jobs running together in the worker's engine", worker=stack.worker)
    stack.worker.kill()  # SIGKILL mid-step: every job in the engine is left `running`
    mid = stack.client.get(f"/v1/batches/{batch_id}").json()
    assert mid["counts"]["succeeded"] < n, "the batch finished before the kill; nothing was tested"
    assert in_engine() == seen, f"{seen} were running while the worker was paused, {in_engine()} after the kill"

    stack.worker.start()
    batch = stack.wait_batch(batch_id)
    assert batch["status"] == "succeeded" and batch["counts"]["succeeded"] == n, batch
    rows = stack.rows("SELECT completions, attempts, status FROM jobs WHERE batch_id = :b", b=key)
    assert len(rows) == n
    assert all(c == 1 and s == "succeeded" for c, _, s in rows), rows
    assert sum(a > 1 for _, a, _ in rows) >= 8  # the killed ones ran again, once
    results = stack.results(batch_id)
    assert [x["id"] for x in results] == list(range(n))
    for x in results:
        jsonschema.validate(x["result"], LONG_SCHEMA)
