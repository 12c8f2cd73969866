"""Delivery guarantees under faults: every job ends, `succeeded` or `failed`, stored exactly
once, with no restart of anything once the faulty part is back (docs/api.md, "Delivery
guarantees" and "Failure behaviour").

Each test runs a real `structspec worker` subprocess (the tiny random Llama) on a throwaway
PostgreSQL database, with Redis or RabbitMQ as the broker (a queue of its own, deleted
afterwards). Result writes are counted by a trigger on `jobs`, independently of the code
under test: every UPDATE that sets `finished_at` or changes `result` adds a row to
`result_writes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import jsonschema
import pytest
import sqlalchemy as sa
from litestar.testing import TestClient

from conftest import AMQP_URL, REDIS_URL, admin_execute, postgres_database, require_url, terminate_connections
from jobs_helpers import query, Worker, build_tiny_model, poll
from structspec.api.app import create_app
from structspec.config import Settings
from structspec.db import migrate
from structspec.db.session import make_engine

BROKERS = {"redis": (REDIS_URL, 6379), "rabbitmq": (AMQP_URL, 5672)}
# `make test` drops Redis's connections; RabbitMQ's in `make test-long` (the prefork test below
# runs on RabbitMQ in both)
LONG_PARAMS = {"test_a_batch_survives_dropped_connections_and_a_database_outage_each_job_stored_once":
               {"broker": "rabbitmq"}}
# Outputs of 80-110 characters, decoded 4 at a time: jobs are still running when the faults strike.
LONG_SCHEMA = {"type": "object",
               "properties": {"note": {"type": "string", "minLength": 80, "maxLength": 110},
                              "label": {"enum": ["a", "b", "c"]}},
               "required": ["note", "label"]}
ALL_JOBS_END_WITHIN_S = 150  # the stated bound: from submission until every job of the batch has ended
CRASHING_WORKER = Path(__file__).with_name("crashing_worker.py")
STALLING_WORKER = Path(__file__).with_name("stalling_worker.py")

COUNT_RESULT_WRITES = """
CREATE TABLE result_writes (job_id uuid NOT NULL, status text NOT NULL);
CREATE FUNCTION count_result_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO result_writes VALUES (NEW.id, NEW.status); RETURN NEW; END $$;
CREATE TRIGGER count_result_write AFTER UPDATE ON jobs FOR EACH ROW
WHEN (NEW.finished_at IS DISTINCT FROM OLD.finished_at OR NEW.result::text IS DISTINCT FROM OLD.result::text)
EXECUTE FUNCTION count_result_write();
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@dataclass
class Deployment:
    settings: Settings
    database: str
    client: TestClient
    worker: Worker
    schema_id: str

    def rows(self, sql: str, **params) -> list:
        return query(self.settings.database_url, sql, **params)

    def submit_batch(self, documents: list[str], max_tokens: int = 192) -> str:
        r = self.client.post("/v1/batches", json={"schema_id": self.schema_id, "options": {"max_tokens": max_tokens},
                                                  "documents": [{"document": d} for d in documents]})
        assert r.status_code == 202, r.text
        return r.json()["id"]

    def statuses(self, batch_id: str) -> Counter:
        return Counter(dict(self.rows("SELECT status, count(*) FROM jobs WHERE batch_id = :b GROUP BY status",
                                      b=batch_id)))

    def ended(self, batch_id: str) -> int:
        s = self.statuses(batch_id)
        return sum(s.values()) - s["queued"] - s["running"]

    def jobs(self, batch_id: str) -> list:
        return self.rows("SELECT id, status, attempts, completions, error, result FROM jobs WHERE batch_id = :b "
                         "ORDER BY position", b=batch_id)

    def result_writes(self, batch_id: str) -> Counter:
        return Counter(dict(self.rows("SELECT w.job_id, count(*) FROM result_writes w JOIN jobs j ON j.id = w.job_id "
                                      "WHERE j.batch_id = :b GROUP BY w.job_id", b=batch_id)))

    def wait_all_ended(self, batch_id: str, total: int, since: float) -> float:
        """Seconds from `since` until every job of the batch has ended; fails past the bound."""
        poll(lambda: self.ended(batch_id) == total, timeout=ALL_JOBS_END_WITHIN_S - (time.monotonic() - since),
             interval=0.5, what=f"all {total} jobs to end within {ALL_JOBS_END_WITHIN_S} s", worker=self.worker)
        return time.monotonic() - since

    def assert_each_stored_once(self, batch_id: str, total: int) -> None:
        jobs = self.jobs(batch_id)
        assert len(jobs) == total
        writes = self.result_writes(batch_id)
        assert {j.id: writes[j.id] for j in jobs} == {j.id: 1 for j in jobs}, "a job's outcome was written twice"
        assert all(j.completions == 1 for j in jobs), [(j.id, j.completions) for j in jobs]


@contextlib.contextmanager
def deployment(broker: str, tiny_model: str, tmp_path: Path, *, lease_s: int = 10, worker_args: tuple = (),
               script: Path | None = None, **settings) -> Iterator[Deployment]:
    """`settings`: more Settings for the API and the worker (engine_watchdog_s, job_timeout_s)."""
    url, port = BROKERS[broker]
    broker_url = require_url(broker, url, port)
    queue = f"structspec-delivery-{uuid.uuid4().hex[:8]}"
    with postgres_database("structspec_test_delivery") as db:
        settings = Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache", database_url=db, broker_url=broker_url,
                            job_queue=queue, job_lease_s=lease_s, job_republish_after_s=lease_s, engine_max_seqs=4,
                            **settings)
        migrate.upgrade(db)
        engine = make_engine(db)
        with engine.begin() as conn:
            conn.exec_driver_sql(COUNT_RESULT_WRITES)
        engine.dispose()
        worker = Worker(settings, tiny_model, tmp_path / "worker.log", args=worker_args, script=script).start()
        try:
            with TestClient(create_app(settings), raise_server_exceptions=False) as client:
                schema = client.post("/v1/schemas", json={"name": "long", "schema": LONG_SCHEMA})
                assert schema.status_code == 201, schema.text
                yield Deployment(settings, sa.engine.make_url(db).database, client, worker, schema.json()["id"])
                client.app.state.engine.dispose()
        finally:
            worker.kill()
            _delete_queue(broker_url, queue)


def _delete_queue(broker_url: str, queue: str) -> None:
    from kombu import Connection

    with contextlib.suppress(Exception), Connection(broker_url, connect_timeout=5) as conn:
        conn.default_channel.queue_delete(queue)


@contextlib.contextmanager
def database_unreachable(database: str):
    """No connection to `database` is accepted (existing ones are terminated) while active."""
    admin_execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS false')
    try:
        terminate_connections(database)
        yield
    finally:
        admin_execute(f'ALTER DATABASE "{database}" WITH ALLOW_CONNECTIONS true')


# --- 1. terminated connections and an outage, on Redis and on RabbitMQ ------------------------

@pytest.mark.parametrize("broker", list(BROKERS))
def test_a_batch_survives_dropped_connections_and_a_database_outage_each_job_stored_once(broker, tiny_model,
                                                                                        tmp_path):
    n = 30
    with deployment(broker, tiny_model, tmp_path) as d:
        t0 = time.monotonic()
        batch_id = d.submit_batch([f"document {i}: label {'abc'[i % 3]}" for i in range(n)])
        poll(lambda: d.statuses(batch_id)["running"] >= 4, timeout=60, interval=0.05,
             what="jobs running in the worker", worker=d.worker)
        # the faults follow at once, while jobs run (on a fast CPU the tiny model can end the
        # whole batch before slower-paced faults begin): every connection dropped, the database
        # unreachable for 5 s, then every connection dropped twice more while the worker recovers
        terminated = terminate_connections(d.database)
        unfinished = n - d.ended(batch_id)
        with database_unreachable(d.database):
            time.sleep(5)
        for _ in range(2):
            terminated += terminate_connections(d.database)
            time.sleep(0.5)
        took = d.wait_all_ended(batch_id, n, t0)
        print(f"\n{broker}: all {n} jobs ended {took:.1f} s after submission; {terminated} connections "
              f"terminated; {unfinished} jobs were unfinished when the outage began")

        assert terminated > 0 and unfinished > 0, "the faults struck no running work; nothing was tested"
        jobs = d.jobs(batch_id)
        assert [j.status for j in jobs] == ["succeeded"] * n, [(j.status, j.error) for j in jobs]
        for j in jobs:
            jsonschema.validate(j.result, LONG_SCHEMA)
        d.assert_each_stored_once(batch_id, n)
        d.worker.check_alive()  # nothing was restarted
        log = d.worker.log.read_text()
        assert "database unavailable" in log or "lease renewal failed" in log, "the worker never saw the outage"


# --- 3. a document that kills its worker every time --------------------------------------------

def test_a_document_that_kills_its_worker_every_time_fails_after_the_cap_and_its_batch_ends(tiny_model, tmp_path):
    """A supervisor (this test) restarts the dead worker each time, as systemd or Kubernetes
    would. The document fails after STRUCTSPEC_JOB_MAX_ATTEMPTS (3) deaths naming the cause;
    its neighbours, killed with it the first time, run alone afterwards and succeed."""
    from crashing_worker import CRASH_MARKER

    with deployment("redis", tiny_model, tmp_path, lease_s=3, script=CRASHING_WORKER) as d:
        documents = [f"document {i}" for i in range(6)]
        documents[2] = f"document 2 {CRASH_MARKER}"
        t0 = time.monotonic()
        batch_id = d.submit_batch(documents)
        deaths = 0
        while d.ended(batch_id) < len(documents):
            assert time.monotonic() - t0 < ALL_JOBS_END_WITHIN_S, f"the batch did not end ({deaths} deaths)"
            if d.worker.proc.poll() is not None:
                assert d.worker.proc.returncode == -signal.SIGKILL, d.worker.log.read_text()[-3000:]
                deaths += 1
                d.worker.start()
            time.sleep(0.2)

        jobs = d.jobs(batch_id)
        poison = jobs[2]
        assert poison.status == "failed" and poison.attempts == 3, poison
        assert poison.error.startswith("the worker died 3 times while running this job"), poison.error
        assert deaths == 3, f"{deaths} worker deaths for a job capped at 3 attempts"
        others = [j for j in jobs if j.id != poison.id]
        assert [j.status for j in others] == ["succeeded"] * 5, [(j.status, j.error) for j in others]
        assert max(j.attempts for j in others) <= 2, [j.attempts for j in others]  # killed once at most
        d.assert_each_stored_once(batch_id, len(documents))
        batch = d.client.get(f"/v1/batches/{batch_id}").json()
        assert batch["finished_at"] and batch["counts"]["failed"] == 1 and batch["counts"]["succeeded"] == 5, batch


# --- 4. a prefork worker's child killed mid-job, on RabbitMQ -----------------------------------

def test_a_prefork_worker_whose_child_is_killed_mid_job_redelivers_and_each_job_completes_once(tiny_model, tmp_path):
    n = 16
    with deployment("rabbitmq", tiny_model, tmp_path, lease_s=3,
                    worker_args=("--pool", "prefork", "--concurrency", "2", "--queues", "model")) as d:
        children = poll(lambda: len(c := d.worker.children()) == 2 and c, timeout=60, what="2 pool processes",
                        worker=d.worker)
        t0 = time.monotonic()
        batch_id = d.submit_batch([f"document {i}" for i in range(n)])
        assert d.settings.job_chunk_size == n // 2  # 16 jobs: two messages, one per process
        # both messages' claims (one lease owner each) have a job started: both processes are mid-job
        poll(lambda: d.rows("SELECT count(DISTINCT lease_owner) FROM jobs WHERE batch_id = :b AND status = 'running' "
                            "AND started_at IS NOT NULL", b=batch_id)[0][0] == 2,
             timeout=60, interval=0.02, what="jobs running in both pool processes", worker=d.worker)
        os.kill(children[0], signal.SIGKILL)  # one pool process, mid-job; the worker itself lives on
        assert d.ended(batch_id) < n, "the batch finished before the kill; nothing was tested"
        took = d.wait_all_ended(batch_id, n, t0)
        print(f"\nprefork: all {n} jobs ended {took:.1f} s after submission")

        jobs = d.jobs(batch_id)
        assert [j.status for j in jobs] == ["succeeded"] * n, [(j.status, j.error) for j in jobs]
        assert any(j.attempts == 2 for j in jobs), "no job was running in the killed process"
        d.assert_each_stored_once(batch_id, n)
        d.worker.check_alive()
        # the pool replaces the killed process (it may not have by the time a fast batch has ended)
        poll(lambda: children[0] not in (c := d.worker.children()) and len(c) == 2, timeout=30,
             what="the pool to replace the killed process", worker=d.worker)
        assert re.search(r"exited with 'signal 9", d.worker.log.read_text()), d.worker.log.read_text()[-3000:]


# --- 5. an engine that hangs: the watchdog ------------------------------------------------------

def test_a_worker_whose_engine_hangs_exits_for_its_supervisor_and_another_worker_finishes_its_jobs(tiny_model,
                                                                                                   tmp_path):
    """The engine hangs in a step (stalling_worker.py) with three jobs in it: after
    STRUCTSPEC_ENGINE_WATCHDOG_S without a step ending the worker stops renewing its leases and
    exits with status 75, though its task threads are blocked waiting on the engine. A healthy
    worker started then (as a supervisor would) re-queues them once their leases run out and
    finishes them; the job that hung had two attempts, each outcome is written once."""
    from stalling_worker import HANG_MARKER
    from structspec.worker.watchdog import EXIT_ENGINE_HUNG

    with deployment("redis", tiny_model, tmp_path, lease_s=3, script=STALLING_WORKER, engine_watchdog_s=2) as d:
        documents = ["document 0", f"document 1 {HANG_MARKER}", "document 2"]
        t0 = time.monotonic()
        batch_id = d.submit_batch(documents)
        exit_code = poll(lambda: d.worker.proc.poll(), timeout=ALL_JOBS_END_WITHIN_S, interval=0.2,
                         what="the hung worker to exit")
        log = d.worker.log.read_text()
        assert exit_code == EXIT_ENGINE_HUNG == 75, log[-3000:]
        assert re.search(r"engine watchdog: no engine step ended for \d+ s while it held work "
                         r"\(STRUCTSPEC_ENGINE_WATCHDOG_S=2\); this worker no longer renews its leases", log), log[-3000:]
        hung = d.jobs(batch_id)[1]
        assert (hung.status, hung.attempts) == ("running", 1)  # held by the dead worker's lease, not failed

        # the supervisor starts a healthy worker, with the default watchdog: a first step of a busy
        # machine's fresh process is no hang
        d.worker.script, d.worker.settings = None, dataclasses.replace(d.settings, engine_watchdog_s=300)
        d.worker.start()
        took = d.wait_all_ended(batch_id, len(documents), t0)
        print(f"\nhung engine: all {len(documents)} jobs ended {took:.1f} s after submission")
        jobs = d.jobs(batch_id)
        assert [j.status for j in jobs] == ["succeeded"] * 3, [(j.status, j.error) for j in jobs]
        assert jobs[1].attempts == 2, [j.attempts for j in jobs]
        d.assert_each_stored_once(batch_id, len(documents))
        d.worker.check_alive()


# --- 6. a job longer than its time limit -----------------------------------------------------------

TIMEOUT_FAILS_WITHIN_S = 20  # the bound, from submission, for a 3 s limit
ENDLESS_SCHEMA = {"type": "object", "properties": {"note": {"type": "string", "minLength": 3000}},
                  "required": ["note"]}  # at least a few hundred steps, each slowed to SLOW_STEP_S


def test_a_job_past_its_time_limit_fails_naming_it_and_the_worker_serves_the_next(tiny_model, tmp_path):
    """options.timeout_s 3 on a document that needs minutes: the engine stops it at the step
    after its limit, freeing its place; the job is `failed` naming the limit (one attempt, not
    run again), and the same worker then runs the next job to success."""
    from stalling_worker import SLOW_MARKER

    with deployment("redis", tiny_model, tmp_path, script=STALLING_WORKER) as d:
        c = d.client
        endless = c.post("/v1/schemas", json={"name": "endless", "schema": ENDLESS_SCHEMA}).json()["id"]

        def run(schema_id: str, document: str, options: dict) -> tuple[dict, float]:
            t0 = time.monotonic()
            r = c.post("/v1/extractions", json={"schema_id": schema_id, "document": document, "options": options})
            assert r.status_code == 202, r.text
            job_id = r.json()["id"]
            job = poll(lambda: (j := c.get(f"/v1/extractions/{job_id}").json())["finished_at"] and j,
                       timeout=ALL_JOBS_END_WITHIN_S, interval=0.1, what=f"job {job_id} to end", worker=d.worker)
            return job, time.monotonic() - t0

        first, _ = run(d.schema_id, "document 0", {"max_tokens": 192})  # the worker is up and serving
        assert first["status"] == "succeeded", first
        late, took = run(endless, f"document 1 {SLOW_MARKER}", {"timeout_s": 3, "max_tokens": 8192,
                                                                 "strategy": "none"})
        print(f"\na 3 s limit: the job failed {took:.1f} s after submission")
        assert late["status"] == "failed", late
        assert late["error"] == ("timeout: the job ran longer than its limit of 3 s (options.timeout_s; server "
                                 "default STRUCTSPEC_JOB_TIMEOUT_S)"), late["error"]
        assert took < TIMEOUT_FAILS_WITHIN_S, took
        [(attempts, options, stats)] = d.rows("SELECT attempts, options, stats FROM jobs WHERE id = :j", j=late["id"])
        assert attempts == 1 and options["timeout_s"] == 3 and stats["stop_reason"] == "timeout"
        after, _ = run(d.schema_id, "document 2", {"max_tokens": 192})
        assert after["status"] == "succeeded", after
        [(options,)] = d.rows("SELECT options FROM jobs WHERE id = :j", j=after["id"])
        assert options["timeout_s"] == d.settings.job_timeout_s  # unset: the server's default
        d.worker.check_alive()
