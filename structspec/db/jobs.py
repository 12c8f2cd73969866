"""Jobs and batches: the SQL behind submission, claiming, storing and reaping.

Exactly-once storage rests on two conditional UPDATEs:
  claim  — queued, or running with an expired lease  ->  running, attempts+1, lease_owner=token
  store  — only WHERE lease_owner = token AND status = 'running'; completions+1
A worker whose lease was taken over (or whose job was cancelled) stores nothing. Like the
other repositories these take a Session and never commit.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any, Iterable, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from structspec.db.columns import utcnow
from structspec.db.models import BatchRecord, JobRecord, TERMINAL_STATUSES

J = JobRecord


class JobRepository:
    def __init__(self, session: Session):
        self.session = session

    def get(self, job_id: uuid.UUID) -> JobRecord | None:
        return self.session.get(JobRecord, job_id)

    def add_many(self, rows: Iterable[dict[str, Any]]) -> list[uuid.UUID]:
        """Insert queued jobs (dicts of column values); returns their ids in order."""
        now = utcnow()
        records = [JobRecord(id=uuid.uuid4(), status="queued", attempts=0, completions=0, created_at=now, **r)
                   for r in rows]
        self.session.add_all(records)
        self.session.flush()
        return [r.id for r in records]

    def delete_many(self, ids: Sequence[uuid.UUID]) -> None:
        self.session.execute(sa.delete(JobRecord).where(J.id.in_(ids)))

    # --- worker side -------------------------------------------------------------------------

    def claim(self, ids: Sequence[uuid.UUID], token: str, lease_s: float) -> list[uuid.UUID]:
        """Take the claimable jobs among `ids` for `token`; returns those taken, in `ids` order."""
        now = utcnow()
        claimable = sa.or_(J.status == "queued", sa.and_(J.status == "running", J.lease_until < now))
        result = self.session.execute(
            sa.update(JobRecord).where(J.id.in_(ids), claimable)
            .values(status="running", attempts=J.attempts + 1, lease_owner=token,
                    lease_until=now + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False))
        if result.rowcount == 0:
            return []
        mine = set(self.session.scalars(sa.select(J.id).where(J.id.in_(ids), J.lease_owner == token,
                                                               J.status == "running")))
        return [i for i in ids if i in mine]

    def renew(self, token: str, lease_s: float) -> int:
        """Extend every lease `token` still holds; returns how many."""
        return self.session.execute(
            sa.update(JobRecord).where(J.lease_owner == token, J.status == "running")
            .values(lease_until=utcnow() + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False)).rowcount

    def held_ids(self, token: str) -> set[uuid.UUID]:
        """Ids of the jobs `token` still holds (running under its lease)."""
        return set(self.session.scalars(sa.select(J.id).where(J.lease_owner == token, J.status == "running")))

    def held(self, job_id: uuid.UUID, token: str) -> JobRecord | None:
        """The job, if `token` still holds it (not cancelled, not taken over)."""
        return self.session.scalars(sa.select(JobRecord).where(
            J.id == job_id, J.lease_owner == token, J.status == "running")).first()

    def mark_started(self, job_id: uuid.UUID, token: str) -> None:
        now = utcnow()
        job = self.held(job_id, token)
        if job is not None:
            if job.started_at is None:
                job.started_at = now
                job.queued_s = (now - job.created_at).total_seconds()
            self.session.flush()

    def store(self, job_id: uuid.UUID, token: str, *, status: str, result: Any = None,
              error: str | None = None, stats: dict[str, Any] | None = None) -> bool:
        """Finish a held job; False (nothing written) when the lease was lost or it was cancelled."""
        values: dict[str, Any] = dict(status=status, result=result, error=error, stats=stats,
                                      finished_at=utcnow(), lease_until=None,
                                      completions=J.completions + 1)
        if stats:
            values.update(prefill_s=stats.get("prefill_s"), decode_s=stats.get("decode_s"))
        return self.session.execute(
            sa.update(JobRecord).where(J.id == job_id, J.lease_owner == token, J.status == "running")
            .values(**values).execution_options(synchronize_session=False)).rowcount == 1

    def requeue_expired(self, token: str, limit: int = 1000) -> list[uuid.UUID]:
        """Put jobs whose lease ran out (their worker died) back to queued; returns their ids
        (tagged with `token` so concurrent reapers each re-send only what they re-queued)."""
        now = utcnow()
        expired = sa.select(J.id).where(J.status == "running", J.lease_until < now).limit(limit)
        ids = list(self.session.scalars(expired))
        if not ids:
            return []
        self.session.execute(
            sa.update(JobRecord).where(J.id.in_(ids), J.status == "running", J.lease_until < now)
            .values(status="queued", lease_owner=token, lease_until=None)
            .execution_options(synchronize_session=False))
        return list(self.session.scalars(sa.select(J.id).where(J.id.in_(ids), J.lease_owner == token,
                                                               J.status == "queued")))

    def refs(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[uuid.UUID, uuid.UUID | None]]:
        """{job id: (schema_id, batch_id)} for `ids` (for log lines)."""
        if not ids:
            return {}
        return {i: (s, b) for i, s, b in self.session.execute(
            sa.select(J.id, J.schema_id, J.batch_id).where(J.id.in_(ids)))}

    # --- cancel --------------------------------------------------------------------------------

    def cancel(self, job_id: uuid.UUID) -> bool:
        """queued/running -> cancelled; False when the job is already finished (or absent)."""
        return self.session.execute(
            sa.update(JobRecord).where(J.id == job_id, J.status.in_(("queued", "running")))
            .values(status="cancelled", finished_at=utcnow(), lease_until=None, error="cancelled")
            .execution_options(synchronize_session=False)).rowcount == 1

    def cancel_unfinished_in_batch(self, batch_id: uuid.UUID) -> int:
        """Every queued or running job of the batch -> cancelled, like `cancel` one by one."""
        return self.session.execute(
            sa.update(JobRecord).where(J.batch_id == batch_id, J.status.in_(("queued", "running")))
            .values(status="cancelled", finished_at=utcnow(), lease_until=None, error="cancelled")
            .execution_options(synchronize_session=False)).rowcount

    # --- batch reads ---------------------------------------------------------------------------

    def counts(self, batch_id: uuid.UUID) -> tuple[dict[str, int], datetime | None]:
        """Jobs per status, and the latest finished_at."""
        rows = self.session.execute(sa.select(J.status, sa.func.count(), sa.func.max(J.finished_at))
                                    .where(J.batch_id == batch_id).group_by(J.status)).all()
        counts = {s: 0 for s in ("queued", "running", *TERMINAL_STATUSES)}
        latest = None
        for status, n, fin in rows:
            counts[status] = n
            if fin is not None and (latest is None or fin > latest):  # max() keeps UTCDateTime
                latest = fin
        return counts, latest

    def batch_page(self, batch_id: uuid.UUID, after: int, limit: int) -> Sequence[JobRecord]:
        """Jobs of a batch with position > `after`, in input order."""
        q = (sa.select(JobRecord).where(J.batch_id == batch_id, J.position > after)
             .order_by(J.position).limit(limit))
        return self.session.scalars(q).all()


class BatchRepository:
    def __init__(self, session: Session):
        self.session = session

    def get(self, batch_id: uuid.UUID) -> BatchRecord | None:
        return self.session.get(BatchRecord, batch_id)

    def add(self, *, tenant: str, schema_id: uuid.UUID, total: int, options: dict[str, Any]) -> BatchRecord:
        record = BatchRecord(id=uuid.uuid4(), tenant=tenant, schema_id=schema_id, total=total, options=options,
                             created_at=utcnow())
        self.session.add(record)
        self.session.flush()
        return record

    def delete(self, batch_id: uuid.UUID) -> None:
        self.session.execute(sa.delete(JobRecord).where(J.batch_id == batch_id))
        self.session.execute(sa.delete(BatchRecord).where(BatchRecord.id == batch_id))
