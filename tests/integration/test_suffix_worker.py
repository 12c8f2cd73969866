"""The suffix proposer's memory through a real `structspec worker` (tiny random Llama): a job
stores its output text as the model wrote it, a new worker process drafts from the outputs
its schema's earlier jobs stored, and one schema's (and one tenant's) outputs never draft
another's. On both stacks (SQLite + embedded broker; PostgreSQL + Redis)."""

from __future__ import annotations

import json
import uuid

import pytest
from litestar.testing import TestClient

from conftest import REDIS_URL, postgres_database, require_url
from jobs_helpers import TINY_SCHEMA, Worker, build_tiny_model, poll, query
from structspec.api.app import create_app
from structspec.config import Settings
from structspec.db import migrate

SUFFIX = {"strategy": "suffix", "draft_len": 8, "max_tokens": 48}
# `make test` runs Redis + PostgreSQL here (test_jobs.py the embedded stack); `make test-long` both
LONG_PARAMS = {"*": {"settings": "embedded"}}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama-suffix")))


@pytest.fixture(params=["embedded", "redis-postgresql"])
def settings(request, tmp_path):
    if request.param == "embedded":
        yield Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache", job_lease_s=10)
        return
    broker = require_url("Redis", REDIS_URL, 6379)
    with postgres_database("structspec_test_suffix") as db:
        yield Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache", database_url=db, broker_url=broker,
                       job_lease_s=10, job_queue=f"structspec-test-{uuid.uuid4().hex[:8]}")


def extract(client, worker, schema_id: str, document: str, options: dict) -> dict:
    r = client.post("/v1/extractions", json={"schema_id": schema_id, "document": document, "options": options})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    job = poll(lambda: (j := client.get(f"/v1/extractions/{job_id}").json())["finished_at"] and j,
               timeout=120, what=f"job {job_id}", worker=worker)
    assert job["status"] == "succeeded", job
    return job


def register(client, name: str) -> str:
    r = client.post("/v1/schemas", json={"name": name, "schema": TINY_SCHEMA})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def test_a_new_worker_drafts_from_the_outputs_stored_before_it_started(settings, tiny_model):
    migrate.upgrade(settings.database_url)
    docs = [f"document {i}: label {'abc'[i % 3]}, ok" for i in range(4)]
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        schema_id = register(client, "suffix-a")
        other_id = register(client, "suffix-b")  # the same body, another schema version of its own
        worker = Worker(settings, tiny_model, settings.data_dir / "worker-1.log").start()
        try:
            first = extract(client, worker, schema_id, docs[0], SUFFIX)
            assert first["stats"]["proposed"] == 0  # nothing learned yet: nothing to draft
            later = [extract(client, worker, schema_id, doc, SUFFIX) for doc in docs[1:]]
            assert sum(j["stats"]["proposed"] for j in later) > 0  # the first output taught the others
        finally:
            worker.kill()
        # each job stored the text the model wrote, whose value is the job's result
        stored = query(settings.database_url, "SELECT id, output, result FROM jobs")
        assert len(stored) == 4
        for _, output, result in stored:
            result = json.loads(result) if isinstance(result, str) else result
            assert output and json.loads(output) == result

        worker = Worker(settings, tiny_model, settings.data_dir / "worker-2.log").start()
        try:
            # a new process: its first job of the schema drafts from what the database holds
            again = extract(client, worker, schema_id, docs[1], SUFFIX)
            assert again["stats"]["proposed"] > 0 and again["stats"]["accepted"] > 0, again["stats"]
            # another schema version learned nothing from these
            fresh = extract(client, worker, other_id, docs[1], SUFFIX)
            assert fresh["stats"]["proposed"] == 0, fresh["stats"]
        finally:
            worker.kill()
