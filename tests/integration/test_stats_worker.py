"""Acceptance statistics end to end: a batch through a real `structspec worker` (tiny
random-weight Llama, as in test_jobs.py), then /v1/schemas/{id}/stats and /metrics report
exactly the sums of the per-job stats, on both stacks (SQLite + embedded broker;
PostgreSQL + Redis)."""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import replace

import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from conftest import REDIS_URL, postgres_database, require_url
from jobs_helpers import TINY_SCHEMA, Worker, build_tiny_model, poll
from structspec.api.app import create_app
from structspec.config import Settings
from structspec.db import migrate

STACKS = ["embedded", "redis-postgresql"]
# `make test` runs Redis + PostgreSQL here (test_jobs.py the embedded stack); `make test-long` both
LONG_PARAMS = {"*": {"stack": "embedded"}}
FIELDS = ("output_tokens", "target_passes", "proposed", "accepted")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama-stats")))


@pytest.fixture(scope="module", params=STACKS)
def stack(request, tiny_model, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(f"stats-{request.param}")
    if request.param == "embedded":
        yield from _run(Settings(data_dir=data_dir, cache_dir=data_dir / "cache", job_lease_s=10), tiny_model)
    else:
        broker = require_url("Redis", REDIS_URL, 6379)
        with postgres_database("structspec_test_stats") as db:
            yield from _run(Settings(data_dir=data_dir, cache_dir=data_dir / "cache", database_url=db,
                                     broker_url=broker, job_lease_s=10,
                                     job_queue=f"structspec-test-{uuid.uuid4().hex[:8]}"), tiny_model)


def _run(settings: Settings, model: str):
    migrate.upgrade(settings.database_url)
    worker = Worker(settings, model, settings.data_dir / "worker.log").start()
    try:
        # the operator's token: /metrics then breaks the totals down per schema
        with TestClient(create_app(replace(settings, metrics_token="operator")), raise_server_exceptions=False) as client:
            yield client, worker
    finally:
        worker.kill()


def run_batch(client, worker, schema_id: str, n: int, options: dict | None = None) -> list[dict]:
    docs = [{"id": i, "document": f"document {i}: label {'abc'[i % 3]}, ok"} for i in range(n)]
    body = {"schema_id": schema_id, "documents": docs, **({"options": options} if options else {})}
    r = client.post("/v1/batches", json=body)
    assert r.status_code == 202, r.text
    bid = r.json()["id"]
    poll(lambda: client.get(f"/v1/batches/{bid}").json()["finished_at"], timeout=180,
         what=f"batch {bid}", worker=worker)
    r = client.get(f"/v1/batches/{bid}/results")
    import json

    return [json.loads(line) for line in r.text.splitlines()]


def test_stats_and_metrics_equal_the_sum_of_per_job_stats(stack):
    client, worker = stack
    schema_id = client.post("/v1/schemas", json={"name": f"tiny-{uuid.uuid4().hex[:6]}",
                                                 "schema": TINY_SCHEMA}).json()["id"]
    results = run_batch(client, worker, schema_id, 24)  # default options: strategy auto
    results += run_batch(client, worker, schema_id, 4, {"strategy": "ngram", "draft_len": 3})
    assert all(r["stats"] for r in results), results
    assert all(r["stats"]["strategy"] != "auto" for r in results)  # auto resolved before the engine
    assert all(r["stats"]["strategy"] == "ngram" and r["stats"]["draft_len"] == 3 for r in results[-4:])

    per_arm: dict[tuple, dict] = defaultdict(lambda: defaultdict(int))
    per_strategy: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    for r in results:
        s = r["stats"]
        for acc in (per_arm[(s["strategy"], s["draft_len"])], per_strategy[s["strategy"]]):
            acc["requests"] += 1
            for f in FIELDS:
                acc[f] += s[f]

    body = client.get(f"/v1/schemas/{schema_id}/stats").json()
    got = {(a["strategy"], a["draft_len"]): {f: a[f] for f in ("requests", *FIELDS)} for a in body["strategies"]}
    assert got == {k: dict(v) for k, v in per_arm.items()}
    assert body["selected"]["strategy"] in ("none", "schema", "ngram", "suffix", "composite")

    text = client.get("/metrics", headers={"authorization": "Bearer operator"}).text
    samples = {(s.name, s.labels["strategy"]): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.labels.get("schema_id") == schema_id and "le" not in s.labels}
    for strategy, acc in per_strategy.items():
        assert samples[("structspec_requests_total", strategy)] == acc["requests"]
        assert samples[("structspec_output_tokens_total", strategy)] == acc["output_tokens"]
        assert samples[("structspec_target_passes_total", strategy)] == acc["target_passes"]
        assert samples[("structspec_draft_tokens_proposed_total", strategy)] == acc["proposed"]
        assert samples[("structspec_draft_tokens_accepted_total", strategy)] == acc["accepted"]
        assert samples[("structspec_job_latency_seconds_count", strategy)] == acc["requests"]
    assert len({k for k, _ in samples}) >= 6


def test_verbatim_jobs_are_counted_apart_and_auto_learns_them_apart(stack):
    client, worker = stack
    schema = {"type": "object", "properties": {"who": {"type": "string"}, "ok": {"type": "boolean"}},
              "required": ["who", "ok"]}
    schema_id = client.post("/v1/schemas", json={"name": f"tiny-str-{uuid.uuid4().hex[:6]}",
                                                 "schema": schema}).json()["id"]
    free = run_batch(client, worker, schema_id, 3, {"strategy": "ngram", "draft_len": 3, "max_tokens": 64})
    verbatim = run_batch(client, worker, schema_id, 3, {"strategy": "ngram", "draft_len": 3, "verbatim": True})
    verbatim += run_batch(client, worker, schema_id, 4, {"verbatim": True})  # auto, verbatim arms only
    assert all(r["status"] == "succeeded" and r["stats"]["verbatim"] for r in verbatim), verbatim
    assert not any(r["stats"]["verbatim"] for r in free)
    docs = [f"document {i}: label {'abc'[i % 3]}, ok" for i in range(4)]
    assert all(r["result"]["who"] in docs[r["id"]] for r in verbatim)  # spans of their own document

    body = client.get(f"/v1/schemas/{schema_id}/stats").json()
    got = {(a["strategy"], a["draft_len"]): a["requests"] for a in body["strategies"]}
    assert got[("ngram", 3)] == 3
    verbatim_arms = {k: v for k, v in got.items() if k[0].endswith("+verbatim")}
    assert sum(verbatim_arms.values()) == 7 and verbatim_arms.get(("ngram+verbatim", 3), 0) >= 3
    # auto on a new verbatim mode probes its proposers afresh: free-mode counts do not satisfy it
    auto_picks = {r["stats"]["strategy"] for r in verbatim[3:]}
    assert {"schema", "composite"} <= auto_picks
