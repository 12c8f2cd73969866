"""OpenAI-format batches (the OpenAI-compatible surface), per tenant: another tenant's id reads
as an unknown one. Their files are in the one file store (db/files.py)."""

from __future__ import annotations

import uuid
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from structspec.db.columns import database_now
from structspec.db.jobs import BatchRepository, open_jobs
from structspec.db.files import new_id, newest_first
from structspec.db.models import OpenAIBatchRecord


class OpenAIBatchRepository:
    def __init__(self, session: Session, tenant: str):
        self.session, self.tenant = session, tenant

    def add(self, **values: Any) -> OpenAIBatchRecord:
        record = OpenAIBatchRecord(id=new_id("batch_"), tenant=self.tenant, created_at=database_now(self.session),
                                   **values)
        self.session.add(record)
        self.session.flush()
        return record

    def get(self, batch_id: str, *, for_update: bool = False) -> OpenAIBatchRecord | None:
        q = sa.select(OpenAIBatchRecord).where(OpenAIBatchRecord.id == batch_id,
                                               OpenAIBatchRecord.tenant == self.tenant)
        return self.session.scalars(q.with_for_update() if for_update else q).first()

    def start_finalizing(self, batch_id: str, status: str, now) -> bool:
        """Take the batch from `status` to finalizing; False when another reader did first."""
        B = OpenAIBatchRecord
        return self.session.execute(
            sa.update(B).where(B.id == batch_id, B.status.in_((status, "in_progress", "cancelling")))
            .values(status="finalizing", finalizing_at=now).execution_options(synchronize_session=False)).rowcount == 1

    def page(self, after: str | None, limit: int) -> Sequence[OpenAIBatchRecord]:
        """Newest first; `after`: the last id of the previous page."""
        q = sa.select(OpenAIBatchRecord).where(OpenAIBatchRecord.tenant == self.tenant)
        return newest_first(self.session, q, OpenAIBatchRecord, after, self.get, limit)


# --- retention (worker/retention.py): every tenant's ------------------------------------------

def delete_expired_openai_batches(session: Session, cutoff, limit: int) -> int:
    """Delete up to `limit` OpenAI-format batches created before `cutoff` whose requests all
    finished before it, with the structspec batch and jobs that ran them; returns how many.
    (Their output files are files: delete_expired_files.)"""
    B = OpenAIBatchRecord
    rows = session.execute(sa.select(B.id, B.batch_id).where(B.created_at < cutoff,
                                                             ~open_jobs(B.batch_id, finished_since=cutoff))
                           .limit(limit)).all()
    for record_id, batch_id in rows:
        session.execute(sa.delete(B).where(B.id == record_id))
        if batch_id is not None:
            BatchRepository(session).delete(batch_id)
    return len(rows)
