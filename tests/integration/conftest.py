"""Integration fixtures: real databases (SQLite file and PostgreSQL), the API over Litestar's
TestClient, and the services policy.

Services policy: a test that needs PostgreSQL, Redis or RabbitMQ and cannot reach it FAILS
when the environment variable CI is set (CI=true, 1, yes), and is skipped with the reason
otherwise. `require_service` is the one place that decides.

Where the services are (defaults are the local ones):
  STRUCTSPEC_TEST_POSTGRES_URL  admin connection, default postgresql://postgres@127.0.0.1:5432/postgres
                                (a throwaway database structspec_test_<random> is created there
                                per test session and dropped at the end)
  STRUCTSPEC_TEST_REDIS_URL     default redis://127.0.0.1:6379/0
  STRUCTSPEC_TEST_AMQP_URL      default amqp://guest:guest@127.0.0.1:5672//
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the project may not be pip-installed
    sys.path.insert(0, str(ROOT))

from structspec.config import Settings  # noqa: E402
from structspec.db import migrate  # noqa: E402
from structspec.db.session import make_engine, make_session_factory, normalize_database_url  # noqa: E402

POSTGRES_ADMIN_URL = os.environ.get("STRUCTSPEC_TEST_POSTGRES_URL",
                                    "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("STRUCTSPEC_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("STRUCTSPEC_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

BACKENDS = ["sqlite", "postgresql"]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def service_unavailable(name: str, why: str) -> None:
    """Fail under CI, skip elsewhere: never silently pass without the service."""
    message = f"{name} is not reachable ({why})"
    if in_ci():
        pytest.fail(f"{message}; CI is set, so this is a failure, not a skip", pytrace=False)
    pytest.skip(f"{message}; start it or set CI=true to make this a failure")


def require_service(name: str, host: str, port: int, timeout: float = 1.0) -> None:
    """Skip (outside CI) or fail (CI set) unless a TCP connection to host:port succeeds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as e:
        service_unavailable(name, f"{host}:{port}: {e.strerror or e}")


def require_url(name: str, url: str, default_port: int) -> str:
    u = make_url(url)
    require_service(name, u.host or "127.0.0.1", u.port or default_port)
    return url


# --- PostgreSQL: one throwaway database per session, plus fresh ones on demand -------------

@contextlib.contextmanager
def postgres_database(prefix: str = "structspec_test") -> Iterator[str]:
    """Create an empty database on the admin server; yield its URL; drop it afterwards."""
    import psycopg

    admin = make_url(POSTGRES_ADMIN_URL)
    require_service("PostgreSQL", admin.host or "127.0.0.1", admin.port or 5432)
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as e:
        service_unavailable("PostgreSQL", f"cannot create a database via {admin.render_as_string()}: {e}")
    try:
        yield admin.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def admin_execute(sql: str, *params):
    """Run `sql` on the admin connection (autocommit); returns its rows."""
    import psycopg

    conninfo = sa.engine.make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql").render_as_string(
        hide_password=False)
    with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def terminate_connections(database: str, pid: int | None = None) -> int:
    """Terminate the backends connected to `database` (or just `pid`); wait until those are
    gone (clients may connect again at once). Returns how many were terminated."""
    where = "datname = %s AND pid <> pg_backend_pid()" + (" AND pid = %s" if pid is not None else "")
    args = (database,) if pid is None else (database, pid)
    killed = [p for p, ok in admin_execute(f"SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
                                           f"WHERE {where}", *args) if ok]
    deadline = time.monotonic() + 10
    while killed and admin_execute("SELECT pid FROM pg_stat_activity WHERE pid = ANY(%s)", killed):
        assert time.monotonic() < deadline, "terminated backends did not go away"
        time.sleep(0.05)
    return len(killed)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.fixture(params=BACKENDS)
def empty_database_url(request, tmp_path) -> Iterator[str]:
    """A database with no tables, on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
    else:
        with postgres_database("structspec_test_empty") as url:
            yield url


@pytest.fixture(scope="session", params=BACKENDS)
def database_url(request, tmp_path_factory) -> str:
    """A database migrated to head, shared by the session; tests clean up via `settings`."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'structspec.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    migrate.upgrade(url)
    return url


@pytest.fixture
def backend(database_url) -> str:
    return make_url(normalize_database_url(database_url)).get_backend_name()


@pytest.fixture
def settings(database_url, tmp_path) -> Iterator[Settings]:
    """Settings for one test: the shared migrated database, an embedded broker in tmp_path.
    Rows written by the test are deleted afterwards."""
    yield Settings(data_dir=tmp_path, cache_dir=tmp_path / "cache", database_url=database_url)
    engine = make_engine(database_url)
    try:
        with engine.begin() as conn:  # jobs and batches first: they reference schemas
            # an API key left behind would turn auth on for the next test
            for table in ("jobs", "batches", "schemas", "api_keys", "idempotency_keys", "files"):
                conn.execute(sa.text(f"DELETE FROM {table}"))
    finally:
        engine.dispose()


@pytest.fixture
def sessions(settings):
    """A session factory on the test's database (the one `client` uses)."""
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def client(settings):
    from litestar.testing import TestClient

    from structspec.api.app import create_app

    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def redis_url() -> str:
    return require_url("Redis", REDIS_URL, 6379)


@pytest.fixture
def amqp_url() -> str:
    return require_url("RabbitMQ", AMQP_URL, 5672)
