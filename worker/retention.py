"""Retention: finished jobs and batches older than STRUCTSPEC_JOB_RETENTION_DAYS are deleted.

Every worker's reaper thread runs `purge_expired` once an hour (worker/tasks.py, Reaper); any
number may run at once, since each round deletes only rows that are already finished. The
cut-off is the database's clock. Deleted: a standalone job (submitted alone or through the
OpenAI-compatible chat route) once it finished before the cut-off, and a batch with all its
jobs once the batch was created, and every job of it finished, before the cut-off. A batch
behind an OpenAI-format batch is kept: that object counts its requests from the jobs (its
output files stay until deleted through /openai/v1/files). Acceptance statistics are
aggregates per schema and stay. Idempotency keys of submissions (db/idempotency.py) are
deleted a day after they were stored, whatever the retention.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from structspec.config import Settings
from structspec.db.columns import database_now
from structspec.db.idempotency import purge_expired_keys
from structspec.db.jobs import BatchRepository, JobRepository

log = logging.getLogger("structspec.worker")

PURGE_EVERY_S = 3600.0
PURGE_CHUNK = 500  # rows per transaction, so a first sweep over a large backlog never holds long locks


def purge_expired(settings: Settings, sessions) -> tuple[int, int]:
    """Delete what finished more than job_retention_days ago; returns (jobs, batches) deleted
    (a batch's jobs are counted with it, not in jobs). Nothing when retention is 0. Expired
    idempotency keys go either way."""
    while True:
        with sessions.begin() as session:
            if purge_expired_keys(session, PURGE_CHUNK) < PURGE_CHUNK:
                break
    if settings.job_retention_days <= 0:
        return 0, 0
    jobs = batches = 0
    while True:
        with sessions.begin() as session:
            cutoff = database_now(session) - timedelta(days=settings.job_retention_days)
            alone = JobRepository(session).finished_alone_before(cutoff, PURGE_CHUNK)
            JobRepository(session).delete_many(alone)
            repo = BatchRepository(session)
            old = repo.finished_before(cutoff, PURGE_CHUNK)
            for batch_id in old:
                repo.delete(batch_id)
        jobs, batches = jobs + len(alone), batches + len(old)
        if len(alone) < PURGE_CHUNK and len(old) < PURGE_CHUNK:
            break
    if jobs or batches:
        log.info("retention: deleted %d job(s) and %d batch(es) finished more than %d day(s) ago", jobs, batches,
                 settings.job_retention_days, extra={"jobs": jobs, "batches": batches})
    return jobs, batches
