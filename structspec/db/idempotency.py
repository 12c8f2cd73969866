"""Idempotency keys of submissions, per tenant (models.IdempotencyKeyRecord).

A key is live for KEY_TTL after the submission that stored it; a repeat of that submission
within it gets the stored answer. The key is written in the same transaction as the jobs, so
a key exists exactly when its jobs were stored; its primary key (tenant, key) makes one of two
concurrent first submissions fail, and that one answers with the winner's stored answer.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from structspec.db.columns import database_now
from structspec.db.models import IdempotencyKeyRecord

K = IdempotencyKeyRecord
KEY_TTL = timedelta(hours=24)


class IdempotencyRepository:
    def __init__(self, session: Session, tenant: str):
        self.session, self.tenant = session, tenant

    def live(self, key: str) -> IdempotencyKeyRecord | None:
        """The key's record if it was stored less than KEY_TTL ago (an older one is deleted)."""
        record = self.session.get(K, (self.tenant, key))
        if record is not None and record.created_at < database_now(self.session) - KEY_TTL:
            self.session.delete(record)
            self.session.flush()
            return None
        return record

    def add(self, key: str, fingerprint: str, response: dict[str, Any]) -> None:
        """Store the key (sqlalchemy.exc.IntegrityError at flush if another request just did)."""
        self.session.add(K(tenant=self.tenant, key=key, fingerprint=fingerprint, response=response,
                           created_at=database_now(self.session)))
        self.session.flush()

    def delete(self, key: str) -> None:
        self.session.execute(sa.delete(K).where(K.tenant == self.tenant, K.key == key))


def purge_expired_keys(session: Session, limit: int) -> int:
    """Delete up to `limit` keys older than KEY_TTL, of every tenant; returns how many."""
    cutoff: datetime = database_now(session) - KEY_TTL
    keys = session.execute(sa.select(K.tenant, K.key).where(K.created_at < cutoff).limit(limit)).all()
    for tenant, key in keys:
        session.execute(sa.delete(K).where(K.tenant == tenant, K.key == key))
    return len(keys)
