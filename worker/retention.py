"""Retention: what finished more than STRUCTSPEC_JOB_RETENTION_DAYS ago is deleted.

Every worker's reaper thread runs `purge_expired` once an hour (worker/tasks.py, Reaper); any
number may run at once, since each round deletes only rows that are already finished. The
cut-off is the database's clock. Deleted, documents and results with them:
- a standalone job (submitted alone, or through the OpenAI-compatible chat route) that
  finished before the cut-off;
- a batch created before the cut-off whose jobs all finished before it, with its jobs;
- likewise an OpenAI-format batch, with the structspec batch and jobs that ran its requests;
- a file (an uploaded batch input, a written batch output) created before the cut-off.
Acceptance statistics are aggregates per schema and stay. Idempotency keys of submissions
(db/idempotency.py) are deleted a day after they were stored, whatever the retention.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable

from sqlalchemy.orm import Session

from structspec.config import Settings
from structspec.db.columns import database_now
from structspec.db.idempotency import purge_expired_keys
from structspec.db.jobs import BatchRepository, JobRepository
from structspec.db.files import delete_expired_files
from structspec.db.openai_batches import delete_expired_openai_batches

log = logging.getLogger("structspec.worker")

PURGE_EVERY_S = 3600.0
PURGE_CHUNK = 500  # standalone jobs, files or idempotency keys per transaction
BATCHES_PER_CHUNK = 10  # batches per transaction (each up to max_batch_size jobs)
MAX_CHUNKS = 20  # transactions per sweep and kind; the reaper sweeps again at its next round if rows are left


@dataclass
class Purged:
    """Rows deleted by one sweep, by kind (a batch's jobs count with the batch)."""

    jobs: int = 0
    batches: int = 0
    openai_batches: int = 0
    files: int = 0
    more: bool = False  # a kind stopped at MAX_CHUNKS with expired rows left
    keys: int = field(default=0, compare=False)


def purge_expired(settings: Settings, sessions) -> Purged:
    """Delete what finished more than job_retention_days ago (nothing when it is 0), and
    expired idempotency keys either way, in short transactions: a first sweep over a large
    backlog neither holds long locks nor keeps the reaper from its leases for long."""
    purged = Purged()
    purged.keys = _in_chunks(sessions, purged, lambda s: purge_expired_keys(s, PURGE_CHUNK), PURGE_CHUNK)
    days = settings.job_retention_days
    if days <= 0:
        return purged

    def cutoff(session: Session):
        return database_now(session) - timedelta(days=days)

    def jobs(session: Session) -> int:
        repo = JobRepository(session)
        ids = repo.finished_alone_before(cutoff(session), PURGE_CHUNK)
        repo.delete_many(ids)
        return len(ids)

    def batches(session: Session) -> int:
        repo = BatchRepository(session)
        ids = repo.finished_before(cutoff(session), BATCHES_PER_CHUNK)
        for batch_id in ids:
            repo.delete(batch_id)
        return len(ids)

    purged.jobs = _in_chunks(sessions, purged, jobs, PURGE_CHUNK)
    purged.batches = _in_chunks(sessions, purged, batches, BATCHES_PER_CHUNK)
    purged.openai_batches = _in_chunks(
        sessions, purged, lambda s: delete_expired_openai_batches(s, cutoff(s), BATCHES_PER_CHUNK), BATCHES_PER_CHUNK)
    purged.files = _in_chunks(sessions, purged, lambda s: delete_expired_files(s, cutoff(s), PURGE_CHUNK), PURGE_CHUNK)
    if purged.jobs or purged.batches or purged.openai_batches or purged.files:
        log.info("retention: deleted %d job(s), %d batch(es), %d OpenAI-format batch(es) and %d file(s) finished "
                 "more than %d day(s) ago", purged.jobs, purged.batches, purged.openai_batches, purged.files, days,
                 extra={"jobs": purged.jobs, "batches": purged.batches, "openai_batches": purged.openai_batches,
                        "files": purged.files})
    return purged


def _in_chunks(sessions, purged: Purged, delete: Callable[[Session], int], chunk: int) -> int:
    """Run `delete` (it deletes up to `chunk` rows, returning how many) in one transaction
    each, until it finds fewer than `chunk` or MAX_CHUNKS ran (then purged.more is set)."""
    total = 0
    for _ in range(MAX_CHUNKS):
        with sessions.begin() as session:
            n = delete(session)
        total += n
        if n < chunk:
            return total
    purged.more = True
    return total
