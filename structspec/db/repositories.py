"""Repositories: the only code that writes SQL. They take a Session and never commit; the
caller owns the transaction."""

from __future__ import annotations

import uuid
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session, defer

from structspec.db.models import DEFAULT_TENANT, ApiKeyRecord, SchemaRecord
from structspec.db.columns import utcnow


class SchemaRepository:
    """Schemas of one tenant; with tenant=None (the worker, which has a job's schema id) any."""

    def __init__(self, session: Session, tenant: str | None = None):
        self.session = session
        self.tenant = tenant

    def _mine(self) -> list:
        return [] if self.tenant is None else [SchemaRecord.tenant == self.tenant]

    def get(self, schema_id: uuid.UUID, *, include_deleted: bool = False) -> SchemaRecord | None:
        record = self.session.get(SchemaRecord, schema_id)
        if record is None or (record.deleted_at is not None and not include_deleted):
            return None
        if self.tenant is not None and record.tenant != self.tenant:
            return None
        return record

    def get_by_name(self, name: str, version: int | None = None) -> SchemaRecord | None:
        """The given version of `name`, or its latest live version; None when deleted or absent."""
        q = sa.select(SchemaRecord).where(SchemaRecord.name == name, SchemaRecord.deleted_at.is_(None),
                                          *self._mine())
        if version is not None:
            q = q.where(SchemaRecord.version == version)
        return self.session.scalars(q.order_by(SchemaRecord.version.desc()).limit(1)).first()

    def find_by_hash(self, name: str, hash_: str) -> SchemaRecord | None:
        """The latest live version of `name` whose content hash is `hash_`."""
        q = (sa.select(SchemaRecord)
             .where(SchemaRecord.name == name, SchemaRecord.hash == hash_, SchemaRecord.deleted_at.is_(None),
                    *self._mine())
             .order_by(SchemaRecord.version.desc()).limit(1))
        return self.session.scalars(q).first()

    def lock_name(self, name: str) -> None:
        """Serialize version allocation for `name` until the transaction ends. Call first in
        the transaction. PostgreSQL: a transaction-scoped advisory lock on the name; SQLite:
        BEGIN IMMEDIATE (takes the database's write lock before the version is read)."""
        dialect = self.session.get_bind().dialect.name
        if dialect == "postgresql":
            self.session.execute(sa.text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
                                 {"key": f"structspec.schemas:{self.tenant}:{name}"})
        elif dialect == "sqlite":
            self.session.execute(sa.text("BEGIN IMMEDIATE"))

    def max_version(self, name: str) -> int:
        """Highest version ever used for `name` (soft-deleted included), 0 if none."""
        q = sa.select(sa.func.max(SchemaRecord.version)).where(SchemaRecord.name == name, *self._mine())
        return self.session.scalar(q) or 0

    def add(self, *, name: str, version: int, body: dict[str, Any], hash_: str,
            description: str | None) -> SchemaRecord:
        now = utcnow()
        record = SchemaRecord(id=uuid.uuid4(), tenant=self.tenant or DEFAULT_TENANT, name=name, version=version,
                              body=body, hash=hash_,
                              description=description, created_at=now, updated_at=now)
        self.session.add(record)
        self.session.flush()  # surfaces a (tenant, name, version) unique violation here
        return record

    def list(self, *, limit: int, offset: int, name: str | None = None) -> tuple[Sequence[SchemaRecord], int]:
        """One page of live records ordered by (name, version desc), without bodies, and the
        total count."""
        where = [SchemaRecord.deleted_at.is_(None), *self._mine()]
        if name is not None:
            where.append(SchemaRecord.name == name)
        total = self.session.scalar(sa.select(sa.func.count()).select_from(SchemaRecord).where(*where)) or 0
        q = (sa.select(SchemaRecord).where(*where).options(defer(SchemaRecord.body))
             .order_by(SchemaRecord.name, SchemaRecord.version.desc()).limit(limit).offset(offset))
        return self.session.scalars(q).all(), total

    def soft_delete(self, record: SchemaRecord) -> None:
        now = utcnow()
        record.deleted_at = now
        record.updated_at = now
        self.session.flush()


class ApiKeyRepository:
    def __init__(self, session: Session):
        self.session = session

    def add(self, *, name: str, tenant: str, key_hash: str, prefix: str) -> ApiKeyRecord:
        record = ApiKeyRecord(id=uuid.uuid4(), name=name, tenant=tenant, key_hash=key_hash, prefix=prefix,
                              created_at=utcnow())
        self.session.add(record)
        self.session.flush()
        return record

    def active_by_hash(self, key_hash: str) -> ApiKeyRecord | None:
        return self.session.scalars(sa.select(ApiKeyRecord).where(
            ApiKeyRecord.key_hash == key_hash, ApiKeyRecord.revoked_at.is_(None))).first()

    def any_active(self) -> bool:
        return self.session.scalar(sa.select(ApiKeyRecord.id).where(ApiKeyRecord.revoked_at.is_(None)).limit(1)) \
            is not None

    def list(self) -> Sequence[ApiKeyRecord]:
        return self.session.scalars(sa.select(ApiKeyRecord).order_by(ApiKeyRecord.created_at)).all()

    def revoke(self, key_id: uuid.UUID) -> ApiKeyRecord | None:
        record = self.session.get(ApiKeyRecord, key_id)
        if record is not None and record.revoked_at is None:
            record.revoked_at = utcnow()
            self.session.flush()
        return record
