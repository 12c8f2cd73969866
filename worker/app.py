"""The Celery app, built from Settings. Tasks live in worker.tasks (`include`), so importing
this module (the API does, to publish) pulls in neither torch nor the model.

    celery -A worker.app worker --pool threads   # or: structspec worker [--concurrency N]
"""

from __future__ import annotations

import uuid
from typing import Iterable, Sequence

from celery import Celery

from structspec.config import Settings
from structspec.db.session import ensure_sqlite_dir

RUN_JOBS = "structspec.run_jobs"


EMBEDDED_BROKER_POLL_S = 0.05  # seconds between the embedded broker's looks for a message


def make_celery(settings: Settings) -> Celery:
    """A Celery app on `settings.broker_url`. The job tasks are idempotent (a conditional
    claim in the database), which is what makes acks_late + reject_on_worker_lost safe."""
    try:
        ensure_sqlite_dir(settings.broker_url)  # the embedded broker's file needs its directory
    except OSError:
        pass  # reported when used (health check 503, submit 503, worker start-up error)
    app = Celery("structspec", broker=settings.broker_url, include=["worker.tasks"])
    if settings.broker_url.startswith("sqla+"):
        # The embedded broker is polled: kombu's virtual transports look for a message once a
        # second when the queue is empty, so a job submitted alone waited 0.5 s on average (up to
        # 1 s) before a worker saw it. Its transport options go to SQLAlchemy's create_engine,
        # which refuses `polling_interval`: the interval is set on kombu's class instead (one
        # small SELECT on the SQLite file per tick).
        from kombu.transport import sqlalchemy as sqla_transport

        sqla_transport.Transport.polling_interval = EMBEDDED_BROKER_POLL_S
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
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0,
                               timeout=settings.submit_timeout_s)
        for chunk in chunks(ids, chunk_size or settings.job_chunk_size):
            app.send_task(RUN_JOBS, args=[chunk], queue=settings.job_queue, retry=False, connection=conn)


def queue_depth(app: Celery) -> int:
    """Messages waiting in the job queue (not those a worker has taken); 0 when the queue does
    not exist (yet, or no longer: Redis drops an empty list). Raises like `enqueue` when the
    broker is unreachable."""
    settings: Settings = app.structspec_settings
    with app.connection_for_read() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0, timeout=settings.submit_timeout_s)
        channel = conn.channel()
        try:
            return channel.queue_declare(queue=settings.job_queue, passive=True).message_count
        except conn.channel_errors:
            return 0
        finally:
            try:
                channel.close()
            except Exception:
                pass


app = make_celery(Settings.from_env())

