"""The Celery app, built from Settings. Tasks live in structspec.worker.tasks (`include`), so importing
this module (the API does, to publish) pulls in neither torch nor the model.

    celery -A structspec.worker.app worker --pool threads   # or: structspec worker [--concurrency N]
"""

from __future__ import annotations

import os
import socket
import uuid
from queue import Empty
from time import monotonic, sleep
from typing import Callable, Iterable, Sequence

from celery import Celery

from structspec.config import Settings
from structspec.db import bells
from structspec.db.session import ensure_sqlite_dir

RUN_JOBS = "structspec.run_jobs"
READ_FILES = "structspec.read_files"  # worker/ingest.py: read the files of jobs, on the ingest queue


EMBEDDED_BROKER_POLL_S = 0.05  # seconds between the embedded broker's looks for a message
# ... while this process's engine is running requests. Each look is ~3 ms of Python (an SQL query
# through SQLAlchemy) in the worker's main thread, which holds the GIL the engine's thread needs
# between its C calls: at 0.05 s the looks took ~5% of a core during a bulk batch on a 2-core CPU
# (docs/benchmarks.md). A job published through `enqueue` rings this process's doorbell and is
# seen at once either way; without a ring (no bell here, another publisher) it joins the batch up
# to this much later (0.1 s on average), a few percent of a job's time there.
EMBEDDED_BROKER_BUSY_POLL_S = 0.2
# ... and where this process has its doorbell, which every publish through `enqueue` rings: the
# looks while busy are then only a safety net for a lost ring
EMBEDDED_BROKER_RUNG_BUSY_POLL_S = 1.0
_engine_busy: Callable[[], bool] = lambda: False
# The embedded broker's file, for this process's doorbell (structspec/db/bells.py): a worker that
# drains the queue binds one at its first look, and `enqueue` rings it, so a job published while
# the worker waits between looks is seen at once rather than at the next look.
_broker_url: str | None = None
_bell: bells.Bell | None = None
_bell_pid: int | None = None


def report_engine_busy(probe: Callable[[], bool]) -> None:
    """Tell the embedded broker's poll how to ask whether this process's engine has requests
    running (worker/tasks.py, once its engine loop exists)."""
    global _engine_busy
    _engine_busy = probe


def _process_bell() -> bells.Bell | None:
    """This process's doorbell on the embedded broker's file, bound at its first look (a prefork
    child binds its own); None where there is none (another broker, or bells do not work here)."""
    global _bell, _bell_pid
    if _broker_url is None:
        return None
    if _bell_pid != os.getpid():
        _bell_pid, _bell = os.getpid(), bells.Bell.open(_broker_url, bells.WORKER)
    return _bell


def _pause(seconds: float) -> bool:
    """Sleep `seconds` between two looks at the embedded broker, less if this process's doorbell
    rings (a job was published); whether it rang."""
    bell = _process_bell()
    if bell is None:
        sleep(seconds)
        return False
    return bell.wait(seconds)


def _busy_poll_s() -> float:
    return EMBEDDED_BROKER_BUSY_POLL_S if _process_bell() is None else EMBEDDED_BROKER_RUNG_BUSY_POLL_S


def drain_polling_by_load(self, connection, timeout=None):
    """kombu's virtual Transport.drain_events for the embedded broker, with the wait between two
    looks at the queue EMBEDDED_BROKER_POLL_S while the engine is idle and
    EMBEDDED_BROKER_BUSY_POLL_S while it is busy (EMBEDDED_BROKER_RUNG_BUSY_POLL_S once this process
    has its doorbell, which wakes it at once), woken every EMBEDDED_BROKER_POLL_S to look at
    once when the engine goes idle (so that a job submitted after the last one finished is seen as
    soon as before). Raises socket.timeout after `timeout` seconds without a message, as kombu's."""
    start = monotonic()
    while True:
        try:
            self.cycle.get(self._deliver, timeout=timeout)
            return
        except Empty:
            pass
        look_at = monotonic() + (_busy_poll_s() if _engine_busy() else EMBEDDED_BROKER_POLL_S)
        while True:
            now = monotonic()
            if timeout is not None and now - start >= timeout:
                raise socket.timeout()
            if now >= look_at:
                break
            if _pause(min(EMBEDDED_BROKER_POLL_S, look_at - now)) or not _engine_busy():
                break


def make_celery(settings: Settings) -> Celery:
    """A Celery app on `settings.broker_url`. The job tasks are idempotent (a conditional
    claim in the database), which is what makes acks_late + reject_on_worker_lost safe."""
    try:
        ensure_sqlite_dir(settings.broker_url)  # the embedded broker's file needs its directory
    except OSError:
        pass  # reported when used (health check 503, submit 503, worker start-up error)
    app = Celery("structspec", broker=settings.broker_url,
                 include=["structspec.worker.tasks", "structspec.worker.ingest"])
    if settings.broker_url.startswith("sqla+"):
        # The embedded broker is polled: kombu's virtual transports look for a message once a
        # second when the queue is empty, so a job submitted alone waited 0.5 s on average (up to
        # 1 s) before a worker saw it. Its transport options go to SQLAlchemy's create_engine,
        # which refuses `polling_interval`: the interval is set on kombu's class instead (one
        # small SELECT on the SQLite file per tick), and its wait made to follow the engine's load
        # (drain_polling_by_load).
        from kombu.transport import sqlalchemy as sqla_transport

        sqla_transport.Transport.polling_interval = EMBEDDED_BROKER_POLL_S
        sqla_transport.Transport.drain_events = drain_polling_by_load
        global _broker_url
        _broker_url = settings.broker_url
    transport_options = {}
    if settings.broker_url.startswith(("redis", "rediss")):
        # An unacked message (its worker died) is redelivered after the job lease; a live worker
        # that is slower than that just sees a duplicate, which the claim turns into a no-op.
        transport_options = {"visibility_timeout": settings.job_lease_s,
                             "socket_connect_timeout": settings.submit_timeout_s,
                             "socket_timeout": max(settings.submit_timeout_s, 10)}
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=settings.job_queue,
        task_ignore_result=True,  # results live in the jobs table, not a result backend
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options=transport_options,  # sqla+: these would go to create_engine()
        broker_connection_timeout=settings.submit_timeout_s,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    app.structspec_settings = settings
    return app


def chunks(ids: Sequence[uuid.UUID], size: int) -> Iterable[list[str]]:
    for i in range(0, len(ids), max(1, size)):
        yield [str(x) for x in ids[i:i + size]]


def enqueue(app: Celery, ids: Sequence[uuid.UUID], chunk_size: int | None = None) -> None:
    """Publish `ids` as run_jobs messages of up to `chunk_size` (default job_chunk_size) ids
    each, over one connection, failing (kombu/redis OperationalError, OSError) within about
    submit_timeout_s when the broker is unreachable."""
    settings: Settings = app.structspec_settings
    _publish(app, RUN_JOBS, settings.job_queue, chunks(ids, chunk_size or settings.job_chunk_size))


def enqueue_reads(app: Celery, ids: Sequence[uuid.UUID]) -> None:
    """Publish `ids` (jobs whose file is to be read) to the ingest queue, one job per message:
    each read takes seconds, and one per message spreads them over every reader. Fails as
    `enqueue` does."""
    _publish(app, READ_FILES, app.structspec_settings.ingest_queue, chunks(ids, 1))


def _publish(app: Celery, task: str, queue: str, messages: Iterable[list[str]]) -> None:
    settings: Settings = app.structspec_settings
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0,
                               timeout=settings.submit_timeout_s)
        for chunk in messages:
            app.send_task(task, args=[chunk], queue=queue, retry=False, connection=conn)
    bells.ring(settings.broker_url, bells.WORKER)  # the embedded broker's workers look now (else: no-op)


def queue_depth(app: Celery, queue: str | None = None) -> int:
    """Messages waiting in `queue` (default: the job queue), not those a worker has taken; 0 when
    the queue does not exist (yet, or no longer: Redis drops an empty list). Raises like `enqueue`
    when the broker is unreachable."""
    settings: Settings = app.structspec_settings
    with app.connection_for_read() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=settings.submit_timeout_s)
        channel = conn.channel()
        try:
            return channel.queue_declare(queue=queue or settings.job_queue, passive=True).message_count
        except conn.channel_errors:
            return 0
        finally:
            try:
                channel.close()
            except Exception:
                pass


app = make_celery(Settings.from_env())

