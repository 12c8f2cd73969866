"""Files and OpenAI-format batches (the OpenAI-compatible surface), per tenant: another
tenant's id reads as an unknown one."""

from __future__ import annotations

import uuid
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from structspec.db.columns import database_now
from structspec.db.models import FileRecord, OpenAIBatchRecord


def new_id(prefix: str) -> str:
    """OpenAI-looking ids: `file-<hex>`, `batch_<hex>`."""
    return prefix + uuid.uuid4().hex


class FileRepository:
    def __init__(self, session: Session, tenant: str):
        self.session, self.tenant = session, tenant

    def add(self, *, purpose: str, filename: str, content: bytes) -> FileRecord:
        record = FileRecord(id=new_id("file-"), tenant=self.tenant, purpose=purpose, filename=filename,
                            bytes=len(content), content=content, created_at=database_now(self.session))
        self.session.add(record)
        self.session.flush()
        return record

    def get(self, file_id: str) -> FileRecord | None:
        record = self.session.get(FileRecord, file_id)
        return record if record is not None and record.tenant == self.tenant else None


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

    def page(self, after: str | None, limit: int) -> Sequence[OpenAIBatchRecord]:
        """Newest first; `after`: the last id of the previous page."""
        B = OpenAIBatchRecord
        q = sa.select(B).where(B.tenant == self.tenant)
        if after is not None:
            cursor = self.get(after)
            if cursor is None:
                return []
            q = q.where(sa.or_(B.created_at < cursor.created_at,
                               sa.and_(B.created_at == cursor.created_at, B.id < cursor.id)))
        return self.session.scalars(q.order_by(B.created_at.desc(), B.id.desc()).limit(limit)).all()
