"""One job through a real worker with the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import jsonschema
import pytest
from litestar.testing import TestClient

from jobs_helpers import TINY_SCHEMA, Worker, poll
from structspec.api.app import create_app
from structspec.config import Settings
from structspec.db import migrate


@pytest.mark.model
@pytest.mark.slow
def test_default_model_job_succeeds_through_a_worker(tmp_path):
    settings = Settings(data_dir=tmp_path, job_lease_s=60)  # default cache_dir: the converted model
    migrate.upgrade(settings.database_url)
    worker = Worker(settings, None, tmp_path / "worker.log").start()
    try:
        with TestClient(create_app(settings)) as c:
            r = c.post("/v1/extractions", json={"schema": TINY_SCHEMA,
                                                "document": "Status report. Label: c. Everything ok: true.",
                                                "options": {"max_tokens": 64}})
            assert r.status_code == 202, r.text
            job = poll(lambda: (j := c.get(f"/v1/extractions/{r.json()['id']}").json())["finished_at"] and j,
                       timeout=150, interval=0.5, what="the default-model job", worker=worker)
        assert job["status"] == "succeeded", job
        jsonschema.validate(job["result"], TINY_SCHEMA)
        # the value itself: the default model reads this document right (`structspec extract
        # --strategy none` gives the same), so a worker that returned any valid value would fail
        assert job["result"] == {"label": "c", "ok": True}, job["result"]
    finally:
        worker.kill()
