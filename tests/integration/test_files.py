"""Files are job work: the API checks a file cheaply and queues the job with phase "reading"; a
reader (worker/ingest.py) reads it and hands the job to the model's queue, or fails it with the
reason's code. Uploads (POST /v1/files) are streamed to the file store and named by id.

The API runs in-process (TestClient) on SQLite and PostgreSQL; the broker is replaced by lists
that record what would be published, and the reader's function is called directly: what runs
the job afterwards is test_jobs.py's business (a real worker).
"""

from __future__ import annotations

import base64
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from integration_helpers import assert_error
from structspec.db.jobs import JobRepository

PDF = (Path(__file__).resolve().parents[1] / "fixtures" / "invoices" / "AzureInterior.pdf").read_bytes()
SCHEMA = {"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}


# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}


def blank_pdf() -> bytes:
    """A PDF of one empty page: it opens and has a page (the submission's checks pass), and
    reading it finds no text (the reader's)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for n, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % n + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 4\n0000000000 65535 f \n" + b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size 4 /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % xref
    return bytes(out)


@pytest.fixture
def published(monkeypatch):
    """What the API and the reader publish: {"jobs": [...], "reads": [...]} (no broker)."""
    import structspec.worker.app
    import structspec.worker.ingest

    sent: dict[str, list[uuid.UUID]] = {"jobs": [], "reads": []}
    monkeypatch.setattr(structspec.worker.app, "enqueue", lambda app, ids, chunk_size=None: sent["jobs"].extend(ids))
    monkeypatch.setattr(structspec.worker.ingest, "enqueue", lambda app, ids, chunk_size=None: sent["jobs"].extend(ids))
    monkeypatch.setattr(structspec.worker.app, "enqueue_reads", lambda app, ids: sent["reads"].extend(ids))
    return sent


def read(settings, sessions, job_id) -> str:
    from structspec.worker.ingest import read_one

    return read_one(sessions, settings, uuid.UUID(str(job_id)))


def job_row(sessions, job_id):
    with sessions() as s:
        return JobRepository(s).get(uuid.UUID(str(job_id)))


def test_a_file_is_checked_at_submission_and_read_by_a_reader_not_the_request(client, settings, sessions,
                                                                              published, monkeypatch):
    import structspec.ingest
    from structspec.ingest import ingest

    def no_reading_here(*a, **k):
        raise AssertionError("the API read the file while the request waited")

    monkeypatch.setattr(structspec.ingest, "read_pdf", no_reading_here)  # the name ingest() calls
    r = client.post("/v1/extractions", json={"schema": SCHEMA, "content": base64.b64encode(PDF).decode(),
                                             "media_type": "application/pdf"})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    job = client.get(f"/v1/extractions/{job_id}").json()
    assert (job["status"], job["phase"]) == ("queued", "reading"), job
    assert published == {"jobs": [], "reads": [uuid.UUID(job_id)]}
    listed = client.get("/v1/extractions").json()["items"]
    assert [(x["id"], x["phase"]) for x in listed] == [(job_id, "reading")]
    monkeypatch.undo()  # the reader reads for real
    published["reads"].clear()
    import structspec.worker.app
    import structspec.worker.ingest
    monkeypatch.setattr(structspec.worker.ingest, "enqueue", lambda app, ids, chunk_size=None: published["jobs"].extend(ids))
    monkeypatch.setattr(structspec.worker.app, "enqueue", lambda app, ids, chunk_size=None: published["jobs"].extend(ids))

    assert read(settings, sessions, job_id) == "read"
    row = job_row(sessions, job_id)
    assert (row.status, row.phase, row.source) == ("queued", None, None)
    assert row.document == ingest(PDF).text and row.layout is not None
    assert published["jobs"] == [uuid.UUID(job_id)]  # handed to the model's queue
    assert read(settings, sessions, job_id) == "skipped"  # a duplicate message reads nothing twice
    assert client.get(f"/v1/extractions/{job_id}").json()["phase"] is None


def test_a_file_that_cannot_be_read_fails_its_job_with_a_code_and_leaves_its_batch_neighbours(
        client, settings, sessions, published):
    sid = client.post("/v1/schemas", json={"name": "who", "schema": SCHEMA}).json()["id"]
    r = client.post("/v1/batches", json={"schema_id": sid, "documents": [
        {"id": "good", "content": base64.b64encode(PDF).decode()},
        {"id": "blank", "content": base64.b64encode(blank_pdf()).decode(), "media_type": "application/pdf"},
        {"id": "text", "document": "Azure Interior"}]})
    assert r.status_code == 202, r.text
    batch = r.json()
    assert batch["total"] == 3 and batch["rejected"] == []
    jobs = {x["id"]: x for x in client.get("/v1/extractions", params={"batch_id": batch["id"]}).json()["items"]}
    assert sorted(x["phase"] or "-" for x in jobs.values()) == ["-", "reading", "reading"]
    assert len(published["reads"]) == 2 and len(published["jobs"]) == 1  # the text one goes to the model at once
    outcomes = {str(j): read(settings, sessions, j) for j in list(published["reads"])}
    assert sorted(outcomes.values()) == ["failed", "read"]
    [failed] = [j for j, o in outcomes.items() if o == "failed"]
    job = client.get(f"/v1/extractions/{failed}").json()
    assert job["status"] == "failed" and job["phase"] is None and job["finished_at"] is not None
    assert job["error"].split(":")[0] in ("no_text_found", "file_unreadable"), job["error"]
    assert "blank" in job["error"] or "no text" in job["error"], job["error"]
    lines = {x["id"]: x for x in map(__import__("json").loads, client.get(
        f"/v1/batches/{batch['id']}/results").text.splitlines())}
    assert lines["blank"]["status"] == "failed" and lines["good"]["status"] == "queued"


def test_a_job_cancelled_or_deleted_while_its_file_waits_is_never_read(client, settings, sessions, published):
    body = {"schema": SCHEMA, "content": base64.b64encode(PDF).decode()}
    cancelled = client.post("/v1/extractions", json=body).json()["id"]
    deleted = client.post("/v1/extractions", json=body).json()["id"]
    assert client.post(f"/v1/extractions/{cancelled}/cancel").json()["status"] == "cancelled"
    assert client.delete(f"/v1/extractions/{deleted}").status_code == 204
    assert read(settings, sessions, cancelled) == "skipped" and read(settings, sessions, deleted) == "skipped"
    assert job_row(sessions, cancelled).status == "cancelled" and published["jobs"] == []


def test_uploaded_files_are_named_by_id_in_extractions_and_batches(client, settings, sessions, published):
    r = client.post("/v1/files", files={"file": ("azure.pdf", PDF, "application/pdf")})
    assert r.status_code == 201, r.text
    up = r.json()
    assert (up["bytes"], up["purpose"], up["media_type"], up["filename"]) == \
        (len(PDF), "user_data", "application/pdf", "azure.pdf")
    assert up["id"].startswith("file-")
    assert client.get(f"/v1/files/{up['id']}/content").content == PDF
    assert [f["id"] for f in client.get("/v1/files").json()["items"]] == [up["id"]]

    sid = client.post("/v1/schemas", json={"name": "who", "schema": SCHEMA}).json()["id"]
    body = {"schema_id": sid, "documents": [{"id": n, "file_id": up["id"]} for n in range(3)]
            + [{"id": "nope", "file_id": "file-0"}, {"id": "both", "file_id": up["id"], "document": "x"}]}
    r = client.post("/v1/batches", json=body)
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert accepted["total"] == 3, accepted
    messages = [x["message"] for x in accepted["rejected"]]
    assert "no file with id file-0" in messages[0] and "not 'document' and 'file_id'" in messages[1], messages
    assert len(published["reads"]) == 3 and all(read(settings, sessions, j) == "read" for j in published["reads"])
    from structspec.ingest import ingest

    assert {job_row(sessions, j).document for j in published["reads"]} == {ingest(PDF).text}

    single = client.post("/v1/extractions", json={"schema_id": sid, "file_id": up["id"]})
    assert single.status_code == 202, single.text
    err = assert_error(client.post("/v1/extractions", json={"schema_id": sid, "file_id": "file-0"}), 404)
    assert "no file with id file-0" in err["detail"]

    # deleted before its job read it: the job fails naming the file
    assert client.delete(f"/v1/files/{up['id']}").status_code == 204
    assert read(settings, sessions, single.json()["id"]) == "failed"
    assert job_row(sessions, single.json()["id"]).error.startswith("file_missing: the uploaded file")
    assert_error(client.get(f"/v1/files/{up['id']}"), 404)


def test_an_upload_over_max_file_bytes_is_413_and_stores_nothing(database_url, tmp_path, sessions):
    from litestar.testing import TestClient

    from structspec.api.app import create_app
    from structspec.config import Settings

    small = Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache", database_url=database_url,
                     max_file_bytes=10_000, max_body_bytes=1000)
    with TestClient(create_app(small), raise_server_exceptions=False) as c:
        err = assert_error(c.post("/v1/files", files={"file": ("a.pdf", PDF, "application/pdf")}), 413)
        assert "max_file_bytes" in err["detail"] and "10000" in err["detail"]
        # under max_file_bytes though over max_body_bytes: uploads have their own limit
        ok = c.post("/v1/files", files={"file": ("b.txt", b"x" * 5000, "text/plain")})
        assert ok.status_code == 201, ok.text
        for bad, status, phrase in [({"files": {"file": ("z.zip", b"PK\x03\x04" + bytes(100), "application/zip")}},
                                     415, "unsupported media type application/zip"),
                                    ({"files": {"file": ("e.pdf", b"", "application/pdf")}}, 400, "non-empty"),
                                    ({"data": {"purpose": "batch"}, "files": {"file": ("b.txt", b"x", "text/plain")}},
                                     422, "purpose 'batch' is not served here"),
                                    ({"data": {"colour": "red"}, "files": {"file": ("b.txt", b"x", "text/plain")}},
                                     422, "unknown multipart field 'colour'")]:
            err = assert_error(c.post("/v1/files", **bad), status)
            assert phrase in err["detail"], err
        assert_error(c.post("/v1/files", json={"file": "x"}), 415)
    with sessions() as s:
        assert s.execute(sa.text("SELECT count(*) FROM files")).scalar() == 1
        assert s.execute(sa.text("SELECT count(*) FROM file_parts")).scalar() == 1
