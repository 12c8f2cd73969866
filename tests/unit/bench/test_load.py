"""bench.load: the percentile and summary helpers (no server, no model)."""

from __future__ import annotations

import pytest

from bench import percentile
from bench.load import documents, markdown, summarize


def test_percentile_interpolates_between_closest_ranks_like_numpy():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0 and percentile(xs, 50) == 3.0
    assert percentile(xs, 25) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile(list(range(1, 201)), 99) == pytest.approx(198.01)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def sub(latency: float, ok: bool = True, code: int = 202) -> dict:
    return {"ok": ok, "status_code": code, "latency_s": latency, **({} if ok else {"error": "locked"})}


def test_summary_counts_errors_statuses_and_throughput():
    subs = [sub(0.1), sub(0.2), sub(0.3), sub(0.4, ok=False, code=500)]
    jobs = {"a": {"status": "succeeded", "turnaround_s": 2.0}, "b": {"status": "failed", "turnaround_s": 4.0},
            "c": {"status": "running"}}
    s = summarize(subs, jobs, first_submit=100.0, last_submit=100.5, last_finish=110.0)
    assert (s["submitted"], s["accepted"], s["errors"]) == (4, 3, 1)
    assert s["error_samples"] == [{"status_code": 500, "error": "locked"}]
    assert (s["succeeded"], s["failed"], s["other"]) == (1, 1, 1)
    assert s["all_finished"] is False  # one job still running and one submission refused
    assert s["submit_ms"]["p50"] == 250.0 and s["submit_ms"]["max"] == 400.0
    assert s["submit_ms"]["p99"] == pytest.approx(397.0)
    assert s["wall_s"] == 10.0 and s["jobs_per_s"] == 0.2  # 2 finished jobs over 10 s
    assert s["submissions_per_s"] == 8.0 and s["turnaround_s"] == {"p50": 3.0, "p99": 3.98}


def test_summary_all_finished_only_when_every_submission_was_accepted_and_finished():
    subs = [sub(0.1), sub(0.1)]
    jobs = {"a": {"status": "succeeded"}, "b": {"status": "cancelled"}}
    s = summarize(subs, jobs, 0.0, 0.1, 4.0)
    assert s["all_finished"] is True and s["errors"] == 0 and s["other"] == 1 and s["jobs_per_s"] == 0.5
    s["concurrency"] = 2
    table = markdown(s, "database sqlite")
    assert "| errors (non-2xx or transport) | 0 |" in table and "| every job finished | yes |" in table


def test_documents_are_short_distinct_and_reproducible():
    docs = documents(200, seed=3)
    assert docs == documents(200, seed=3) and len(set(docs)) == 200
    assert all(40 < len(d) < 120 for d in docs)


def test_a_service_reads_the_started_and_finished_times_of_its_batch_s_jobs(tmp_path):
    """Service.job_spans: the worker's stamps of one batch's finished jobs, as epoch seconds
    (bench.peer splits a batch's wall time with them); other batches and unfinished jobs left out."""
    import uuid
    from datetime import datetime, timezone

    import sqlalchemy as sa

    from bench.load import Service
    from structspec.db.models import Base, BatchRecord, JobRecord

    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    engine = sa.create_engine(url)  # no foreign keys enforced: the jobs' schema is not needed here
    Base.metadata.create_all(engine)
    mine, other, schema = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    at = lambda s: datetime.fromtimestamp(s, timezone.utc)  # noqa: E731

    def job(batch, started, finished):
        return {"id": uuid.uuid4(), "tenant": "t", "schema_id": schema, "batch_id": batch, "document": "d",
                "options": {}, "started_at": started and at(started), "finished_at": finished and at(finished)}

    with engine.begin() as conn:
        for b in (mine, other):
            conn.execute(sa.insert(BatchRecord), {"id": b, "tenant": "t", "total": 2, "options": {}})
        conn.execute(sa.insert(JobRecord), [job(mine, 1000.5, 1003.0), job(mine, 1001.0, 1004.25),
                                            job(mine, 1002.0, None), job(other, 900.0, 901.0)])
    engine.dispose()
    svc = Service(database_url=url)
    try:
        assert sorted(svc.job_spans(str(mine))) == [(1000.5, 1003.0), (1001.0, 1004.25)]
    finally:
        import shutil
        shutil.rmtree(svc.data_dir, ignore_errors=True)
