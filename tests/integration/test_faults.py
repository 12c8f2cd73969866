"""Failure behaviour: what the API and the worker do when the broker, the database or the model
is not there, and that they recover by themselves once it is back.

- Redis: a private `redis-server` on a free port (the shared one is never touched), stopped and
  started again on the same port while the app and a real `structspec worker` keep running.
- PostgreSQL: a throwaway database whose connections are terminated with pg_terminate_backend,
  between requests and, through a cursor hook, during one; and a URL on a closed port.
- Model: `structspec worker` with STRUCTSPEC_MODEL=/nonexistent.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import sqlalchemy as sa
from litestar.testing import TestClient

from conftest import postgres_database, service_unavailable, terminate_connections
from integration_helpers import assert_error
from jobs_helpers import TINY_SCHEMA, Worker, build_tiny_model, poll, query
from structspec.api.app import create_app
from structspec.config import Settings
from structspec.db import migrate

JOB_TIMEOUT = 60
UNAVAILABLE_WITHIN_S = 10  # the bound for a 503 instead of a hang


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counts(settings: Settings) -> tuple[int, int]:
    """(jobs, batches) rows in the database."""
    [row] = query(settings.database_url, "SELECT (SELECT count(*) FROM jobs), (SELECT count(*) FROM batches)")
    return tuple(row)


def timed(call):
    t0 = time.monotonic()
    r = call()
    return r, time.monotonic() - t0


# --- a private Redis --------------------------------------------------------------------------

@dataclass
class PrivateRedis:
    port: int
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not Path(binary).is_file():
            service_unavailable("Redis", "no redis-server binary to run a private Redis")
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no"], stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                service_unavailable("Redis", f"private redis-server on port {self.port} did not start: "
                                             f"{self.log.read_text()[-2000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def private_redis(tmp_path) -> Iterator[PrivateRedis]:
    redis = PrivateRedis(free_port(), tmp_path / "redis.log")
    redis.start()
    try:
        yield redis
    finally:
        redis.stop()


def submit(client: TestClient, schema_id: str, document: str = "label a, ok"):
    return client.post("/v1/extractions", json={"schema_id": schema_id, "document": document})


def submit_batch(client: TestClient, schema_id: str):
    return client.post("/v1/batches", json={"schema_id": schema_id,
                                            "documents": [{"document": "one"}, {"document": "two"}]})


def wait_job(client: TestClient, job_id: str, worker: Worker) -> dict:
    return poll(lambda: (j := client.get(f"/v1/extractions/{job_id}").json())["finished_at"] and j,
                timeout=JOB_TIMEOUT, what=f"job {job_id}", worker=worker)


def assert_broker_503(r, elapsed: float) -> None:
    err = assert_error(r, 503)
    assert elapsed < UNAVAILABLE_WITHIN_S, f"503 took {elapsed:.1f} s"
    assert "broker" in err["detail"] and "nothing was stored" in err["detail"]
    assert [e["source"] for e in err["errors"]] == ["broker"]
    assert r.headers.get("retry-after") == "5"


def test_redis_down_is_503_and_after_a_restart_submission_and_workers_recover_by_themselves(
        private_redis, tiny_model, tmp_path):
    settings = Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache", broker_url=private_redis.url,
                        submit_timeout_s=2, job_lease_s=5, job_queue=f"faults-{uuid.uuid4().hex[:8]}")
    migrate.upgrade(settings.database_url)
    worker = Worker(settings, tiny_model, tmp_path / "worker.log").start()
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            schema_id = client.post("/v1/schemas", json={"name": "tiny", "schema": TINY_SCHEMA}).json()["id"]
            before = submit(client, schema_id)
            assert before.status_code == 202, before.text
            assert wait_job(client, before.json()["id"], worker)["status"] == "succeeded"
            rows = counts(settings)

            private_redis.stop()
            assert_broker_503(*timed(lambda: submit(client, schema_id)))
            assert_broker_503(*timed(lambda: submit_batch(client, schema_id)))
            assert counts(settings) == rows, "a refused submission left rows behind"
            assert client.get(f"/v1/extractions/{before.json()['id']}").status_code == 200  # reads need no broker
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["broker"].startswith("error: "), health.text

            private_redis.start()  # same port, same app object, same worker process
            after = submit(client, schema_id)
            assert after.status_code == 202, after.text
            batch = submit_batch(client, schema_id)
            assert batch.status_code == 202, batch.text
            assert wait_job(client, after.json()["id"], worker)["status"] == "succeeded"
            done = poll(lambda: (b := client.get(f"/v1/batches/{batch.json()['id']}").json())["finished_at"] and b,
                        timeout=JOB_TIMEOUT, what="the batch", worker=worker)
            assert done["counts"]["succeeded"] == 2, done
            assert client.get(f"/v1/extractions/{before.json()['id']}").json()["status"] == "succeeded"
    finally:
        worker.kill()


def test_unreachable_broker_is_503_within_seconds_and_stores_nothing(tmp_path):
    """No server at all on the port (never started): the connect is refused at once."""
    settings = Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache",
                        broker_url=f"redis://127.0.0.1:{free_port()}/0", submit_timeout_s=2)
    migrate.upgrade(settings.database_url)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        schema_id = client.post("/v1/schemas", json={"name": "tiny", "schema": TINY_SCHEMA}).json()["id"]
        assert_broker_503(*timed(lambda: submit(client, schema_id)))
        assert_broker_503(*timed(lambda: submit_batch(client, schema_id)))
        ndjson = client.post(f"/v1/batches?schema_id={schema_id}", content=b'{"document": "x"}\n',
                             headers={"content-type": "application/x-ndjson"})
        assert_broker_503(ndjson, 0)
    assert counts(settings) == (0, 0)


# --- PostgreSQL -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pg(tmp_path_factory):
    """A migrated throwaway database and the app on it (embedded broker: no worker needed)."""
    with postgres_database("structspec_test_faults") as url:
        migrate.upgrade(url)
        data_dir = tmp_path_factory.mktemp("pg-faults")
        settings = Settings(data_dir=data_dir, cache_dir=data_dir / "cache", database_url=url)
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            schema_id = client.post("/v1/schemas", json={"name": "tiny", "schema": TINY_SCHEMA}).json()["id"]
            yield client, schema_id, sa.engine.make_url(url).database
            client.app.state.engine.dispose()


@contextlib.contextmanager
def kill_connection_at(engine: sa.Engine, database: str, statement_prefix: str):
    """While active, the first statement starting with `statement_prefix` finds its connection
    terminated by the server (the hook kills the backend just before the statement is sent)."""
    hits = []

    def before(conn, cursor, statement, parameters, context, executemany):
        if not hits and statement.lstrip().upper().startswith(statement_prefix):
            pid = conn.connection.dbapi_connection.info.backend_pid
            hits.append(terminate_connections(database, pid))

    sa.event.listen(engine, "before_cursor_execute", before)
    try:
        yield hits
    finally:
        sa.event.remove(engine, "before_cursor_execute", before)
    assert hits == [1], "the hook never killed a connection; nothing was tested"


def assert_database_503(r) -> dict:
    err = assert_error(r, 503)
    assert "database" in err["detail"]
    assert [e["source"] for e in err["errors"]] == ["database"]
    return err


def test_postgres_connections_terminated_between_requests_are_replaced_without_an_error(pg):
    client, schema_id, database = pg
    job = submit(client, schema_id)
    assert job.status_code == 202, job.text
    assert client.get(f"/v1/extractions/{job.json()['id']}").status_code == 200  # pool has a connection
    assert terminate_connections(database) >= 1
    r = client.get(f"/v1/extractions/{job.json()['id']}")
    assert r.status_code == 200, r.text  # pre-ping found the dead connection and reconnected
    assert r.json()["status"] == "queued"
    assert terminate_connections(database) >= 1
    again = submit(client, schema_id, "after the drop")
    assert again.status_code == 202, again.text


def test_postgres_connection_dropped_during_a_read_is_503_and_the_next_request_succeeds(pg):
    client, schema_id, database = pg
    job_id = submit(client, schema_id).json()["id"]
    with kill_connection_at(client.app.state.engine, database, "SELECT"):
        assert_database_503(client.get(f"/v1/extractions/{job_id}"))
    r = client.get(f"/v1/extractions/{job_id}")
    assert r.status_code == 200 and r.json()["id"] == job_id, r.text  # nothing lost, no restart


def test_postgres_connection_dropped_during_a_write_is_503_stores_nothing_and_recovers(pg):
    client, schema_id, database = pg
    earlier = submit(client, schema_id).json()["id"]
    engine = client.app.state.engine
    with engine.connect() as conn:
        before = conn.scalar(sa.text("SELECT count(*) FROM jobs"))
    with kill_connection_at(engine, database, "INSERT INTO JOBS"):
        assert_database_503(submit(client, schema_id, "lost in the drop"))
    with kill_connection_at(engine, database, "INSERT INTO BATCHES"):
        assert_database_503(submit_batch(client, schema_id))
    with engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM jobs")) == before
    assert submit(client, schema_id).status_code == 202
    assert client.get(f"/v1/extractions/{earlier}").json()["status"] == "queued"


def test_unreachable_database_is_503_on_v1_routes_and_health_names_it(tmp_path):
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/structspec_nowhere"
    settings = Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache", database_url=url)
    some_id = uuid.uuid4()
    calls = [("GET", "/v1/schemas", None), ("POST", "/v1/schemas", {"name": "t", "schema": TINY_SCHEMA}),
             ("GET", f"/v1/schemas/{some_id}", None),
             ("POST", "/v1/extractions", {"schema_id": str(some_id), "document": "d"}),
             ("POST", "/v1/extractions", {"schema": TINY_SCHEMA, "document": "d"}),
             ("GET", f"/v1/extractions/{some_id}", None),
             ("POST", "/v1/batches", {"schema_id": str(some_id), "documents": [{"document": "d"}]}),
             ("GET", f"/v1/batches/{some_id}/results", None)]
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        for method, path, body in calls:
            r, elapsed = timed(lambda: client.request(method, path, json=body))
            err = assert_database_503(r)
            assert elapsed < UNAVAILABLE_WITHIN_S, f"{method} {path} took {elapsed:.1f} s"
            assert "127.0.0.1" in err["errors"][0]["message"], err  # says what could not be reached
        r = client.get("/health")
        assert r.status_code == 503, r.text
        assert r.json()["database"].startswith("error: ") and r.json()["broker"] == "ok"


# --- model ------------------------------------------------------------------------------------

def test_worker_that_cannot_load_its_model_exits_naming_it_and_jobs_stay_queued(tiny_model, tmp_path):
    settings = Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache", job_lease_s=5)
    migrate.upgrade(settings.database_url)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        schema_id = client.post("/v1/schemas", json={"name": "tiny", "schema": TINY_SCHEMA}).json()["id"]
        job_id = submit(client, schema_id).json()["id"]

        bad = Worker(settings, "/nonexistent", tmp_path / "bad-worker.log").start()
        try:
            code = bad.proc.wait(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a worker without its model kept running:\n{bad.log.read_text()[-4000:]}")
        finally:
            bad.kill()
        log = bad.log.read_text()
        assert code != 0, log
        assert "cannot load model '/nonexistent'" in log and "Traceback" not in log, log
        job = client.get(f"/v1/extractions/{job_id}").json()
        assert job["status"] == "queued" and job["error"] is None, job

        good = Worker(settings, tiny_model, tmp_path / "worker.log").start()
        try:  # the job's message was never taken: a working worker runs it
            assert wait_job(client, job_id, good)["status"] == "succeeded"
        finally:
            good.kill()
