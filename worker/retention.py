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
from dataclasses import dataclass
from datetime import timedelta

from structspec.config import Settings
from structspec.db.columns import database_now
from structspec.db.idempotency import purge_expired_keys
from structspec.db.jobs import BatchRepository, JobRepository

log = logging.getLogger("structspec.worker")

PURGE_EVERY_S = 3600.0
PURGE_CHUNK = 500  # standalone jobs, or idempotency keys, per transaction
BATCHES_PER_CHUNK = 10  # batches per transaction (each up to max_batch_size jobs)
MAX_CHUNKS = 20  # transactions per sweep and kind; the reaper sweeps again at its next round if rows are left


@dataclass(frozen=True)
class Purged:
    jobs: int  # standalone jobs (a batch's jobs are counted with the batch)
    batches: int
    more: bool  # the sweep stopped at MAX_CHUNKS with expired rows left


def purge_expired(settings: Settings, sessions) -> Purged:
    """Delete what finished more than job_retention_days ago (nothing when it is 0), and
    expired idempotency keys either way, in short transactions: a first sweep over a large
    backlog neither holds long locks nor keeps the reaper from its leases for long."""
    keys_left, chunks = True, 0
    while keys_left and chunks < MAX_CHUNKS:
        with sessions.begin() as session:
            keys_left = purge_expired_keys(session, PURGE_CHUNK) == PURGE_CHUNK
        chunks += 1
    if settings.job_retention_days <= 0:
        return Purged(0, 0, keys_left)
    jobs = batches = chunks = 0
    left = True
    while left and chunks < MAX_CHUNKS:
        with sessions.begin() as session:
            cutoff = database_now(session) - timedelta(days=settings.job_retention_days)
            alone = JobRepository(session).finished_alone_before(cutoff, PURGE_CHUNK)
            JobRepository(session).delete_many(alone)
            repo = BatchRepository(session)
            old = repo.finished_before(cutoff, BATCHES_PER_CHUNK)
            for batch_id in old:
                repo.delete(batch_id)
        jobs, batches, chunks = jobs + len(alone), batches + len(old), chunks + 1
        left = len(alone) == PURGE_CHUNK or len(old) == BATCHES_PER_CHUNK
    if jobs or batches:
        log.info("retention: deleted %d job(s) and %d batch(es) finished more than %d day(s) ago", jobs, batches,
                 settings.job_retention_days, extra={"jobs": jobs, "batches": batches})
    return Purged(jobs, batches, keys_left or left)
