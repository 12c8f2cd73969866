"""Acceptance statistics in the database (SQLite and PostgreSQL), without a worker: the
repository's aggregation, the stats endpoint, strategy pins, `auto` resolution and /metrics.
The end-to-end check through a real worker is tests/integration/test_stats_worker.py."""

from __future__ import annotations

import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest
from integration_helpers import assert_error
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from structspec.api.app import create_app
from structspec.db.stats import StatsRepository
from structspec.options import RequestOptions
from structspec.stats.aggregate import InMemoryStats
from structspec.services.strategy import acceptance_curve, concrete_options
from structspec.stats.selector import Selector

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}}, "required": ["label"]}


# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}


def job_stats(strategy: str, k: int, passes: int, acc_pos: list[int], decode_s: float = 0.1) -> dict:
    accepted = sum(acc_pos)
    return {"strategy": strategy, "draft_len": k, "output_tokens": passes + accepted, "target_passes": passes,
            "proposed": passes * k, "accepted": accepted, "decode_s": decode_s,
            "accepted_by_position": acc_pos, "proposed_by_position": [passes] * k}


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


METRICS_TOKEN = "operator-scrape-token"  # /metrics per schema is the operator's view


@pytest.fixture
def client(settings):
    with TestClient(create_app(replace(settings, metrics_token=METRICS_TOKEN)), raise_server_exceptions=False) as c:
        yield c


def metric_samples(client) -> dict[tuple, float]:
    r = client.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"})
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


def batched_stats(strategy: str, k: int, reached: list[int], acc_pos: list[int], batch_size: float) -> dict:
    """A batched engine's job: the scheduler offered fewer than k positions in some passes."""
    return {**job_stats(strategy, k, reached[0], acc_pos), "proposed_by_position": reached,
            "proposed": sum(reached), "reached_by_position": reached, "batch_size": batch_size}


def test_reached_and_batch_size_round_trip_through_the_database(client, sessions, schema_id):
    """The repository folds the new keys exactly as InMemoryStats does, old-style jobs
    (no reached_by_position, no batch_size) included, and reads them back."""
    jobs = [job_stats("ngram", 4, 5, [4, 3, 2, 0]),  # old style: reached derived, batch size 1
            batched_stats("ngram", 4, [6, 4, 2, 1], [4, 2, 1, 0], 7.5),
            batched_stats("ngram", 4, [3, 1], [1, 0], 2.25),  # never offered past position 1
            {**job_stats("schema", 2, 4, [3]), "proposed": 4,  # the grammar cut every draft to 1:
             "proposed_by_position": [4]}]  # position 1 reached 3 times, never drafted
    memory = InMemoryStats(500)
    for j in jobs:
        record(sessions, schema_id, j)
        memory.record(j)
    sid = uuid.UUID(schema_id)
    with sessions() as session:
        stored = {(a.strategy, a.draft_len): a for a in StatsRepository(session).arms(sid)}
        views = StatsRepository(session).views(sid, 500)
    assert set(stored) == set(memory.arms)
    for key, want in memory.arms.items():
        got = stored[key]
        assert (got.reached_by_position, got.proposed_by_position, got.accepted_by_position) == \
            (want.reached_by_position, want.proposed_by_position, want.accepted_by_position)
        assert got.d_reached_by_position == want.d_reached_by_position  # the same arithmetic, exactly
        assert got.batch_size_sum == want.batch_size_sum
    assert stored[("ngram", 4)].reached_by_position == [5 + 6 + 3, 4 + 4 + 1, 3 + 2, 2 + 1]
    assert stored[("ngram", 4)].batch_size_sum == 1.0 + 7.5 + 2.25
    assert stored[("schema", 2)].reached_by_position == [4, 3]
    want_views = {v.strategy: v for v in memory.views()}
    for v in views:
        assert v.reached_by_position == want_views[v.strategy].reached_by_position

    body = client.get(f"/v1/schemas/{schema_id}/stats").json()
    arms = {(a["strategy"], a["draft_len"]): a for a in body["strategies"]}
    assert arms[("ngram", 4)]["mean_batch_size"] == round(10.75 / 3, 4)
    assert arms[("schema", 2)]["mean_batch_size"] == 1.0
    assert arms[("schema", 2)]["proposed_by_position"] == [4, 0]  # the reached-only position shows
    m = metric_samples(client)
    assert m[("structspec_job_batch_size_total", schema_id, "ngram", None)] == pytest.approx(10.75)
    assert m[("structspec_job_batch_size_total", schema_id, "schema", None)] == 1.0


def test_acceptance_curve_is_the_selector_mean_over_the_mode_pinned_or_not(client, sessions, schema_id, settings):
    sid = uuid.UUID(schema_id)
    # 10 passes offered position 1 only 4 times (all accepted at 0): 3 of 4 accepted there
    record(sessions, schema_id, {**job_stats("ngram", 4, 10, [1, 0, 0, 0]), "verbatim": True})
    record(sessions, schema_id, batched_stats("ngram", 4, [10, 4, 3], [8, 3, 1], 4.0))  # last: undecayed
    with sessions() as session:
        curve = acceptance_curve(session, settings, sid, "ngram", 4)
        views = StatsRepository(session).views(sid, settings.stats_half_life)
    free = [v for v in views if v.strategy == "ngram"]
    assert curve == Selector().draft_acceptance(free, "ngram", 4)
    assert curve == Selector().acceptance(free, "ngram", 4)  # every pass that reached a position drafted it
    assert curve[0] == pytest.approx((1 + 8) / (2 + 10))  # Beta(1, 1) prior
    assert curve[1] == pytest.approx((curve[0] * 2 + 3) / (2 + 4))  # trials: reached, not accepted at 0
    r = client.put(f"/v1/schemas/{schema_id}/strategy", json={"strategy": "schema", "draft_len": 4})
    assert r.status_code == 200, r.text
    with sessions() as session:
        assert acceptance_curve(session, settings, sid, "ngram", 4) == curve  # a pin does not hide the data
        verbatim = acceptance_curve(session, settings, sid, "ngram", 4, verbatim=True)
        assert verbatim[0] == pytest.approx((1 + 1) / (2 + 10), rel=1e-3)  # verbatim jobs only (decayed a request)
        assert acceptance_curve(session, settings, sid, "composite", 2) == [0.5, 0.5]  # no data: the prior
        assert acceptance_curve(session, settings, sid, "ngram", 0) == []
        # a job's curve is a Thompson draw from the same posteriors, reproducible per job
        job = uuid.uuid4()
        drawn = acceptance_curve(session, settings, sid, "ngram", 4, job_id=job)
        assert drawn == acceptance_curve(session, settings, sid, "ngram", 4, job_id=job) != curve
        assert all(0 < c < 1 for c in drawn)
        draws = [acceptance_curve(session, settings, sid, "ngram", 1, job_id=uuid.uuid4())[0] for _ in range(400)]
        assert sum(draws) / len(draws) == pytest.approx(curve[0], abs=0.03)  # centred on the mean


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
        opts = concrete_options(session, settings, sid, uuid.uuid4(), RequestOptions(strategy="auto"))
        assert (opts.strategy, opts.draft_len) == ("ngram", 6)
        explicit = concrete_options(session, settings, sid, uuid.uuid4(), RequestOptions(strategy="schema", draft_len=3))
        assert (explicit.strategy, explicit.draft_len) == ("schema", 3)
    r = client.put(f"/v1/schemas/{schema_id}/strategy", json={"strategy": "auto"})
    assert r.status_code == 200 and r.json()["pinned"] is None and r.json()["selected_by"] == "estimate"


def test_auto_resolution_is_reproducible_per_job_and_keeps_a_given_draft_len(sessions, schema_id, settings):
    sid, job = uuid.UUID(schema_id), uuid.uuid4()
    with sessions() as session:
        a = concrete_options(session, settings, sid, job, RequestOptions(strategy="auto", temperature=0.5))
        b = concrete_options(session, settings, sid, job, RequestOptions(strategy="auto", temperature=0.5))
        assert a == b and a.strategy in ("none", "schema", "ngram", "composite")
        assert a.temperature == 0.5  # only strategy and draft_len are chosen
        fixed = [concrete_options(session, settings, sid, uuid.uuid4(), RequestOptions(strategy="auto", draft_len=3))
                 for _ in range(20)]
    assert {c.draft_len for c in fixed} == {3}
    assert {c.strategy for c in fixed} <= {"schema", "ngram", "composite"}


def test_stats_errors_are_4xx(client, schema_id):
    assert_error(client.get(f"/v1/schemas/{uuid.uuid4()}/stats"), 404)
    assert_error(client.get("/v1/schemas/not-a-uuid/stats"), 404)
    body = assert_error(client.put(f"/v1/schemas/{schema_id}/strategy", json={"strategy": "bogus"}), 422)
    assert body["errors"][0]["path"] == "/strategy"
    assert body["errors"][0]["message"] == "strategy must be one of none, schema, ngram, suffix, composite, not 'bogus'"
    body = assert_error(client.put(f"/v1/schemas/{schema_id}/strategy", json={"strategy": "ngram", "draft_len": 99}),
                        422)
    assert body["errors"][0]["path"] == "/draft_len"
    assert body["errors"][0]["message"] == "draft_len must be between 0 and 64, not 99"
    assert_error(client.put(f"/v1/schemas/{uuid.uuid4()}/strategy", json={"strategy": "ngram"}), 404)


def test_job_options_default_to_auto_and_reject_unknown_strategies(client, schema_id, settings):
    from structspec.api.services.jobs import JobService
    from structspec.api.structs import JobOptions

    svc = JobService(None, settings, None)
    assert svc.request_options(None) == RequestOptions(strategy="auto", draft_len=None, max_tokens=settings.max_tokens,
                                                       timeout_s=settings.job_timeout_s)
    assert svc.request_options(JobOptions(strategy="auto", draft_len=4)).draft_len == 4
    assert svc.request_options(JobOptions(strategy="ngram")).draft_len == settings.draft_len
    body = assert_error(client.post("/v1/extractions", json={"schema_id": schema_id, "document": "x",
                                                             "options": {"strategy": "fastest"}}), 422)
    assert body["errors"][0]["path"] == "/options/strategy"
    assert body["errors"][0]["message"] == "strategy must be one of auto, none, schema, ngram, suffix, composite, not 'fastest'"


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


class FakeLoop:
    """The worker's engine loop replaced by a fixed answer per request (a finished Future)."""

    def __init__(self, answer):
        self.answer, self.requests = answer, []

    def submit(self, request):
        from concurrent.futures import Future

        self.requests.append(request)
        future = Future()
        future.set_result(self.answer(request))
        return future

    def cancel(self, request_id):
        pass


def engine_result(request):
    opts = request.options
    stats = job_stats(opts.strategy, opts.draft_len or 1, 2, [1] * (opts.draft_len or 1))
    return SimpleNamespace(status="succeeded", value={"label": "a"}, error=None, spans={}, confidence={},
                           text='{"label": "a"}', stats=SimpleNamespace(as_dict=lambda: stats, stop_reason="grammar"))


def run_one(tasks, sessions, settings, job_id, token) -> int:
    """One held job through the worker's start -> engine -> finish path; jobs stored."""
    started = tasks.start_job(sessions, settings, job_id, token)
    if not isinstance(started, tasks.Started):
        return started
    future = tasks.PROCESS.loop(settings).submit(started.request)
    return tasks.finish_job(sessions, settings, started, future, token)


def test_worker_resolves_auto_and_records_stats_with_the_result_only_while_it_holds_the_lease(
        sessions, schema_id, settings, monkeypatch):
    """The worker with its engine replaced by a fixed outcome: `auto` reaches the engine as a
    concrete strategy with the schema's acceptance curve; stats are written in the result's
    transaction, and not at all when the result is not stored (lease lost / cancelled)."""
    from structspec.db.jobs import JobRepository
    from structspec.worker import tasks

    loop = FakeLoop(engine_result)
    monkeypatch.setattr(tasks.PROCESS, "loop", lambda _settings: loop)
    sid = uuid.UUID(schema_id)
    with sessions.begin() as s:
        jobs = JobRepository(s).add_many([dict(schema_id=sid, document="d", options={"strategy": "auto", "draft_len": None,
                                                                                        "temperature": 0.0, "seed": None,
                                                                                        "max_tokens": 64,
                                                                                        "timeout_s": 600})
                                          for _ in range(3)])
        assert JobRepository(s).claim(jobs, "w1", 60) == jobs
    assert run_one(tasks, sessions, settings, jobs[0], "w1") == 1
    assert run_one(tasks, sessions, settings, jobs[1], "w1") == 1
    first = loop.requests[0]
    assert first.options.strategy in ("schema", "ngram", "composite") and first.options.draft_len == 8  # probes
    assert first.options.check(concrete=True).max_tokens == 64  # what the engine gets: concrete
    assert first.id == str(jobs[0])
    # an auto job's draft lengths adapt to the batch: it carries its strategy's acceptance curve
    assert len(first.acceptance) == 8 and all(0 < c < 1 for c in first.acceptance)
    assert tasks.IN_FLIGHT.pending(sid, False) == {}  # recorded jobs are no longer pending

    def cancel_then_answer(request):  # the job is cancelled while it decodes: nothing is stored
        with sessions.begin() as s:
            JobRepository(s).cancel(jobs[2])
        return engine_result(request)

    loop.answer = cancel_then_answer
    assert run_one(tasks, sessions, settings, jobs[2], "w1") == 0
    with sessions() as s:
        arms = StatsRepository(s).arms(sid)
    assert sum(a.requests for a in arms) == 2
    assert sum(sum(a.latency_buckets) for a in arms) == 2
    assert tasks.IN_FLIGHT.pending(sid, False) == {}


def test_worker_fails_a_job_whose_stored_options_it_cannot_read_naming_the_option(
        sessions, schema_id, settings, monkeypatch):
    """A row written by another version is failed with the option named, never left running
    for the reaper to re-queue forever."""
    from structspec.db.jobs import JobRepository
    from structspec.worker import tasks

    monkeypatch.setattr(tasks.PROCESS, "loop", lambda _settings: pytest.fail("the engine ran"))
    sid = uuid.UUID(schema_id)
    with sessions.begin() as s:
        [job] = JobRepository(s).add_many([dict(schema_id=sid, document="d", options={"strategy": "auto", "beam": 4})])
        assert JobRepository(s).claim([job], "w1", 60) == [job]
    assert run_one(tasks, sessions, settings, job, "w1") == 1
    with sessions() as s:
        stored = JobRepository(s).get(job)
        assert (stored.status, stored.error) == (
            "failed", "stored options cannot be used: unknown option 'beam'; options are strategy, draft_len, "
                      "temperature, seed, max_tokens, verbatim, chunking, timeout_s")
