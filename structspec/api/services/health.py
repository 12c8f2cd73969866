"""Readiness of the database and the broker, each check bounded in time, the answer cached for
a second per process (probecache.py): a flood of probes costs one check a second."""

from __future__ import annotations

import concurrent.futures as cf
import logging

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from structspec.api.errors import ErrorItem, one_line
from structspec.api.services.probecache import ProbeCache
from structspec.api.structs import HealthFailure, HealthReport
from structspec.db.session import ensure_sqlite_dir

log = logging.getLogger(__name__)


class HealthService:
    def __init__(self, engine: Engine, broker_url: str, *, timeout: float = 3.0, cache: ProbeCache | None = None):
        self.engine = engine
        self.broker_url = broker_url
        self.timeout = timeout
        self.cache = cache or ProbeCache()
        # A hung check keeps its thread, so this pool is private to health checks; the
        # checks themselves carry their own connect timeouts, so threads come back.
        self._pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="health")
        self._head: str | None = None

    def check(self) -> HealthReport | HealthFailure:
        """The report of the last check, when it started less than `cache.ttl_s` ago; else a new
        one (callers meanwhile wait for it): so at most `cache.ttl_s` plus `timeout` old."""
        return self.cache.get("report", self.check_now)

    def check_now(self) -> HealthReport | HealthFailure:
        """Run both checks concurrently; each gets at most `timeout` seconds."""
        futures = {"database": self._pool.submit(self._check_database),
                   "broker": self._pool.submit(check_broker, self.broker_url, self.timeout)}
        cf.wait(futures.values(), timeout=self.timeout)
        results = {name: _outcome(f, self.timeout) for name, f in futures.items()}
        if all(v == "ok" for v in results.values()):
            return HealthReport(status="ok", **results)
        failing = [name for name, v in results.items() if v != "ok"]
        return HealthFailure(status_code=503, detail=f"unavailable: {', '.join(failing)}",
                             errors=[ErrorItem(message=results[n], source=n) for n in failing],
                             status="error", **results)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_database(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
            if not sa.inspect(conn).has_table("alembic_version"):
                raise RuntimeError("database is not migrated (run `structspec migrate`)")
            current = conn.scalar(sa.text("SELECT version_num FROM alembic_version"))
        head = self._head_revision()
        if head is not None and current != head:
            raise RuntimeError(f"database is at migration {current or 'none'}, this code needs {head} "
                               "(run `structspec migrate`)")

    def _head_revision(self) -> str | None:
        if self._head is None:
            from structspec.db.migrate import head_revision

            self._head = head_revision()
        return self._head


def check_broker(url: str, timeout: float) -> None:
    """Raise unless the broker accepts a connection within about `timeout` seconds."""
    from kombu import Connection

    ensure_sqlite_dir(url)
    # transport_options go to redis-py socket settings, but to create_engine() for sqla+.
    options = {"socket_timeout": timeout, "socket_connect_timeout": timeout} if url.startswith("redis") else {}
    with Connection(url, connect_timeout=timeout, transport_options=options) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=timeout)
        if conn.transport.driver_name == "sqlalchemy":
            # Virtual transports connect lazily: touch the database for a real answer.
            channel = conn.default_channel
            channel.session.execute(sa.text("SELECT 1"))
            channel.session.close()


def _outcome(future: cf.Future, timeout: float) -> str:
    if not future.done():
        future.cancel()
        return f"error: no answer within {timeout:g} s"
    exc = future.exception()
    if exc is None:
        return "ok"
    log.warning("health check failed: %s", exc)
    return f"error: {one_line(exc)}"

