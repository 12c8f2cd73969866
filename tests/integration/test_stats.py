"""Acceptance statistics in the database (SQLite and PostgreSQL), without a worker: the
repository's aggregation, the stats endpoint, strategy pins, `auto` resolution and /metrics.
The end-to-end check through a real worker is tests/integration/test_stats_worker.py."""

from __future__ import annotations

import uuid

import pytest
from integration_helpers import assert_error
from prometheus_client.parser import text_string_to_metric_families

from structspec.db.session import make_engine, make_session_factory
from structspec.db.stats import StatsRepository
from structspec.stats.resolve import resolve_options

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}}, "required": ["label"]}


def job_stats(strategy: str, k: int, passes: int, acc_pos: list[int], decode_s: float = 0.1) -> dict:
    accepted = sum(acc_pos)
    return {"strategy": strategy, "draft_len": k, "output_tokens": passes + accepted, "target_passes": passes,
            "proposed": passes * k, "accepted": accepted, "decode_s": decode_s,
            "accepted_by_position": acc_pos, "proposed_by_position": [passes] * k}


@pytest.fixture
def sessions(settings):
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def schema_id(client, sessions) -> str:
    sid = client.post("/v1/schemas", json={"name": "stats-test", "schema": SCHEMA}).json()["id"]
    yield sid
    from structspec.db.models import JobRecord

    with sessions.begin() as s:  # jobs do not cascade; the settings fixture then deletes the schema
        s.query(JobRecord).filter(JobRecord.schema_id == uuid.UUID(sid)).delete()


def record(sessions, schema_id: str, stats: dict, latency_s: float = 0.3) -> None:
    with sessions.begin() as session:
        StatsRepository(session).record(uuid.UUID(schema_id), stats, half_life=500, latency_s=latency_s)


def metric_samples(client) -> dict[tuple, float]:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, s.labels.get("schema_id"), s.labels.get("strategy"), s.labels.get("le"))] = s.value
    return out


def test_jobs_aggregate_into_one_row_per_arm_with_exact_totals(client, sessions, schema_id):
    jobs = [job_stats("schema", 4, 5, [5, 4, 2, 1]), job_stats("schema", 4, 3, [3, 3, 3, 0]),
            job_stats("ngram", 2, 10, [2, 1], decode_s=0.5)]
    for s in jobs:
        record(sessions, schema_id, s)
    body = client.get(f"/v1/schemas/{schema_id}/stats").json()
    assert body["schema_id"] == schema_id and body["pinned"] is None
    arms = {(a["strategy"], a["draft_len"]): a for a in body["strategies"]}
    assert set(arms) == {("schema", 4), ("ngram", 2)}
    s4 = arms[("schema", 4)]
    assert (s4["requests"], s4["target_passes"], s4["proposed"], s4["accepted"]) == (2, 8, 32, 21)
    assert s4["output_tokens"] == 8 + 21 and s4["accepted_by_position"] == [8, 7, 5, 1]
    assert s4["proposed_by_position"] == [8, 8, 8, 8]
    assert s4["acceptance_rate"] == round(21 / 32, 4) and s4["tokens_per_pass"] == round(29 / 8, 4)
    assert s4["tokens_per_second"] == pytest.approx(29 / 0.2, rel=1e-3)
    assert body["selected"]["strategy"] in ("none", "schema", "ngram", "composite")
    with sessions() as session:  # the tables stay small: one row per arm, one per position
        assert len(StatsRepository(session).arms(uuid.UUID(schema_id))) == 2


def test_metrics_render_the_database_totals_per_schema_and_strategy(client, sessions, schema_id):
    record(sessions, schema_id, job_stats("schema", 4, 5, [5, 4, 2, 1]), latency_s=0.2)
    record(sessions, schema_id, job_stats("schema", 2, 3, [3, 1]), latency_s=7.0)
    m = metric_samples(client)
    key = lambda name, le=None: (name, schema_id, "schema", le)  # noqa: E731
    assert m[key("structspec_requests_total")] == 2
    assert m[key("structspec_draft_tokens_proposed_total")] == 20 + 6
    assert m[key("structspec_draft_tokens_accepted_total")] == 12 + 4
    assert m[key("structspec_target_passes_total")] == 8
    assert m[key("structspec_output_tokens_total")] == 17 + 7
    assert m[key("structspec_job_latency_seconds_count")] == 2
    assert m[key("structspec_job_latency_seconds_bucket", "0.25")] == 1
    assert m[key("structspec_job_latency_seconds_bucket", "10.0")] == 2
    assert m[key("structspec_job_latency_seconds_sum")] == pytest.approx(7.2)


def test_pin_overrides_auto_and_auto_unpins(client, sessions, schema_id, settings):
    r = client.put(f"/v1/schemas/{schema_id}/strategy", json={"strategy": "ngram", "draft_len": 6})
    assert r.status_code == 200, r.text
    assert r.json()["pinned"] == {"strategy": "ngram", "draft_len": 6}
    assert r.json()["selected"] == {"strategy": "ngram", "draft_len": 6} and r.json()["selected_by"] == "pinned"
    sid = uuid.UUID(schema_id)
    with sessions() as session:
        opts = resolve_options(session, settings, sid, uuid.uuid4(), {"strategy": "auto", "draft_len": None})
        assert (opts["strategy"], opts["draft_len"]) == ("ngram", 6)
        explicit = resolve_options(session, settings, sid, uuid.uuid4(), {"strategy": "schema", "draft_len": 3})
        assert (explicit["strategy"], explicit["draft_len"]) == ("schema", 3)
    r = client.put(f"/v1/schemas/{schema_id}/strategy", json={"strategy": "auto"})
    assert r.status_code == 200 and r.json()["pinned"] is None and r.json()["selected_by"] == "estimate"


def test_auto_resolution_is_reproducible_per_job_and_keeps_a_given_draft_len(sessions, schema_id, settings):
    sid, job = uuid.UUID(schema_id), uuid.uuid4()
    with sessions() as session:
        a = resolve_options(session, settings, sid, job, {"strategy": "auto", "draft_len": None})
        b = resolve_options(session, settings, sid, job, {"strategy": "auto", "draft_len": None})
        assert a == b and a["strategy"] in ("none", "schema", "ngram", "composite")
        fixed = [resolve_options(session, settings, sid, uuid.uuid4(), {"strategy": "auto", "draft_len": 3})
                 for _ in range(20)]
    assert {c["draft_len"] for c in fixed} == {3}
    assert {c["strategy"] for c in fixed} <= {"schema", "ngram", "composite"}


def test_stats_errors_are_4xx(client, schema_id):
    assert_error(client.get(f"/v1/schemas/{uuid.uuid4()}/stats"), 404)
    assert_error(client.get("/v1/schemas/not-a-uuid/stats"), 404)
    body = assert_error(client.put(f"/v1/schemas/{schema_id}/strategy", json={"strategy": "bogus"}), 422)
    assert body["errors"][0]["path"] == "/strategy"
    assert_error(client.put(f"/v1/schemas/{schema_id}/strategy", json={"strategy": "ngram", "draft_len": 99}), 422)
    assert_error(client.put(f"/v1/schemas/{uuid.uuid4()}/strategy", json={"strategy": "ngram"}), 404)


def test_job_options_default_to_auto_and_reject_unknown_strategies(client, schema_id, settings):
    from structspec.api.services.jobs import JobService
    from structspec.api.structs import JobOptions

    svc = JobService(None, settings, None)
    assert svc.resolve_options(None)["strategy"] == "auto" and svc.resolve_options(None)["draft_len"] is None
    assert svc.resolve_options(JobOptions(strategy="auto", draft_len=4))["draft_len"] == 4
    assert svc.resolve_options(JobOptions(strategy="ngram"))["draft_len"] == settings.draft_len
    body = assert_error(client.post("/v1/extractions", json={"schema_id": schema_id, "document": "x",
                                                             "options": {"strategy": "fastest"}}), 422)
    assert body["errors"][0]["path"] == "/options/strategy"


def test_concurrent_writers_add_exactly(client, sessions, schema_id):
    import threading

    errors = []

    def writer():
        try:
            for _ in range(10):
                record(sessions, schema_id, job_stats("composite", 3, 2, [2, 1, 0]))
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    [arm] = client.get(f"/v1/schemas/{schema_id}/stats").json()["strategies"]
    assert (arm["requests"], arm["target_passes"], arm["accepted"]) == (40, 80, 120)
    assert arm["accepted_by_position"] == [80, 40, 0]


def test_worker_resolves_auto_and_records_stats_with_the_result_only_while_it_holds_the_lease(
        sessions, schema_id, settings, monkeypatch):
    """worker.tasks.run_one with the engine replaced by a fixed outcome: `auto` reaches the
    engine as a concrete strategy; stats are written in the result's transaction, and not at
    all when the result is not stored (lease lost / cancelled)."""
    from structspec.db.jobs import JobRepository
    from worker import tasks

    seen = []

    def fake_extract(_settings, _schema, _document, options):
        seen.append(options)
        return {"status": "succeeded", "result": {"label": "a"},
                "stats": job_stats(options["strategy"], options["draft_len"] or 1, 2, [1] * (options["draft_len"] or 1))}

    monkeypatch.setattr(tasks, "extract", fake_extract)
    sid = uuid.UUID(schema_id)
    with sessions.begin() as s:
        jobs = JobRepository(s).add_many([dict(schema_id=sid, document="d", options={"strategy": "auto", "draft_len": None,
                                                                                        "temperature": 0.0, "seed": None,
                                                                                        "max_tokens": 64})
                                          for _ in range(3)])
        assert JobRepository(s).claim(jobs, "w1", 60) == jobs
    assert tasks.run_one(sessions, settings, jobs[0], "w1") == 1
    assert tasks.run_one(sessions, settings, jobs[1], "w1") == 1
    assert seen[0]["strategy"] in ("schema", "ngram", "composite") and seen[0]["draft_len"] == 8  # first: probes

    def cancel_then_extract(*args):  # the job is cancelled while it decodes: nothing is stored
        with sessions.begin() as s:
            JobRepository(s).cancel(jobs[2])
        return fake_extract(*args)

    monkeypatch.setattr(tasks, "extract", cancel_then_extract)
    assert tasks.run_one(sessions, settings, jobs[2], "w1") == 0
    with sessions() as s:
        arms = StatsRepository(s).arms(sid)
    assert sum(a.requests for a in arms) == 2
    assert sum(sum(a.latency_buckets) for a in arms) == 2
