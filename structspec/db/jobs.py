"""Jobs and batches: the SQL behind submission, claiming, storing and reaping.

Exactly-once storage rests on two conditional UPDATEs:
  claim  — queued  ->  running, attempts+1, lease_owner=token, lease_until
  store  — only WHERE lease_owner = token AND status = 'running'; completions+1
A worker whose lease was taken over (or whose job was cancelled) stores nothing. A job whose
lease ran out goes back to `queued` through `requeue_expired`, or fails there once it has
had `max_attempts` attempts. Every
time here is the database's clock (columns.database_now). Like the other repositories these
take a Session and never commit.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any, Iterable, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session, load_only

from structspec.db import bells
from structspec.db.columns import database_now
from structspec.db.models import BatchRecord, JobRecord, OpenAIBatchRecord, TERMINAL_STATUSES

J = JobRecord

# PostgreSQL: the channel on which a trigger on `jobs` (revision 0014) NOTIFYs a job's id when it
# ends, its streamed output grows or it is deleted (api/services/waiting.py listens)
JOB_CHANGES_CHANNEL = "structspec_jobs"

# SQLite has no trigger that can reach another process. The writes that the trigger reports (a job
# ends, its streamed output grows, it is deleted) all go through the methods below, which mark
# their session; when that session commits, the API processes of this machine are rung
# (structspec/db/bells.py) and their job waiter reads at once. Like NOTIFY, the ring follows
# the commit, so a woken waiter reads the committed row.
_JOBS_CHANGED = "structspec.jobs_changed"


def _mark_changed(session: Session) -> None:
    session.info[_JOBS_CHANGED] = True


@sa.event.listens_for(Session, "after_commit")
def _ring_waiters(session: Session) -> None:
    if not session.info.pop(_JOBS_CHANGED, False):
        return
    try:
        bind = session.get_bind()
    except Exception:  # a session without one bind: nothing to ring (the waiters' tick reads it)
        return
    if bind.dialect.name == "sqlite":
        bells.ring(bind.url.render_as_string(hide_password=False), bells.API)


class JobRepository:
    def __init__(self, session: Session):
        self.session = session

    def get(self, job_id: uuid.UUID) -> JobRecord | None:
        return self.session.get(JobRecord, job_id)

    def add_many(self, rows: Iterable[dict[str, Any]]) -> list[uuid.UUID]:
        """Insert queued jobs (dicts of column values); returns their ids in order."""
        now = database_now(self.session)
        records = [JobRecord(id=uuid.uuid4(), status="queued", attempts=0, completions=0, created_at=now,
                             published_at=now, **r)
                   for r in rows]
        self.session.add_all(records)
        self.session.flush()
        return [r.id for r in records]

    def delete_many(self, ids: Sequence[uuid.UUID]) -> None:
        """Delete the jobs `ids`, whatever their status: a worker running one of them stores
        nothing (its conditional UPDATE finds no row) and its lease keeper stops it."""
        self.session.execute(sa.delete(JobRecord).where(J.id.in_(ids)))
        _mark_changed(self.session)

    def finished_alone_before(self, cutoff: datetime, limit: int) -> list[uuid.UUID]:
        """Ids of finished jobs outside any batch that finished before `cutoff` (retention)."""
        return list(self.session.scalars(sa.select(J.id).where(
            J.batch_id.is_(None), J.status.in_(TERMINAL_STATUSES), J.finished_at < cutoff).limit(limit)))

    def page(self, tenant: str, *, limit: int, offset: int, status: str | None = None,
             batch_id: uuid.UUID | None = None, schema_id: uuid.UUID | None = None) -> tuple[Sequence[JobRecord], int]:
        """One page of the tenant's jobs, newest first, with only the columns of a summary (no
        document or result), and the total count under the same filters."""
        summary = load_only(J.id, J.status, J.phase, J.schema_id, J.batch_id, J.error, J.created_at, J.finished_at)
        return newest_page(self.session, JobRecord, limit, offset, tenant=tenant, status=status, batch_id=batch_id,
                           schema_id=schema_id, options=(summary,))

    def backlog(self) -> dict[str, tuple[int, datetime | None]]:
        """{"queued" | "running": (jobs, the oldest one's created_at)}, over every tenant (/metrics)."""
        out: dict[str, tuple[int, datetime | None]] = {"queued": (0, None), "running": (0, None)}
        rows = self.session.execute(sa.select(J.status, sa.func.count(), sa.func.min(J.created_at))
                                    .where(J.status.in_(tuple(out))).group_by(J.status)).all()
        for status, n, oldest in rows:
            out[status] = (n, oldest)
        return out

    # --- worker side -------------------------------------------------------------------------

    def claim(self, ids: Sequence[uuid.UUID], token: str, lease_s: float) -> list[uuid.UUID]:
        """Take the `queued` jobs among `ids` for `token`; returns those taken, in `ids` order.
        A job on a later attempt is taken only by a message of its own (the reaper sends it so),
        never with others: it must run alone (worker/tasks.py, Isolation). A job whose lease
        ran out comes back through the reaper (`requeue_expired`), which counts its attempts."""
        now = database_now(self.session)
        # a job whose file is still to be read (phase "reading") is the ingest worker's, not ours
        queued = sa.and_(J.status == "queued", J.phase.is_(None))
        claimable = queued if len(ids) == 1 else sa.and_(queued, J.attempts == 0)
        self.session.execute(
            sa.update(JobRecord).where(J.id.in_(ids), claimable)
            .values(status="running", attempts=J.attempts + 1, lease_owner=token,
                    lease_until=now + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False))
        # Ours too when an earlier try of this claim committed but its reply was lost (db/retry.py).
        mine = set(self.session.scalars(sa.select(J.id).where(J.id.in_(ids), J.lease_owner == token,
                                                               J.status == "running")))
        return [i for i in ids if i in mine]

    # --- reading files (worker/ingest.py) ------------------------------------------------------
    # A job whose file is unread is `queued` with phase "reading". A reader takes it with a lease
    # (lease_owner/lease_until, as a running job's), reads the file and either hands the job on
    # (document stored, phase NULL, published to the model queue) or fails it. A reader that dies
    # leaves the lease to run out; the reaper publishes the job again (claim_stranded), and after
    # max_attempts reads the job fails instead of crashing readers forever.

    def claim_read(self, job_id: uuid.UUID, token: str, lease_s: float, max_attempts: int) -> str:
        """Take a job to read its file: "claimed"; "exhausted" when `max_attempts` reads have been
        tried already (the caller fails it, holding it); "skip" when it is not there to read
        (cancelled, deleted, read already, or held by a live reader)."""
        now = database_now(self.session)
        free = sa.and_(J.id == job_id, J.status == "queued", J.phase == "reading",
                       sa.or_(J.lease_until.is_(None), J.lease_until < now))
        taken = self.session.execute(
            sa.update(JobRecord).where(free)
            .values(lease_owner=token, lease_until=now + timedelta(seconds=lease_s), read_attempts=J.read_attempts + 1)
            .execution_options(synchronize_session=False)).rowcount == 1
        if not taken:
            return "skip"
        attempts = self.session.scalar(sa.select(J.read_attempts).where(J.id == job_id))
        return "exhausted" if attempts > max_attempts else "claimed"

    def reading(self, job_id: uuid.UUID, token: str) -> JobRecord | None:
        """The job, while `token` holds it to read its file."""
        return self.session.scalars(sa.select(JobRecord).where(
            J.id == job_id, J.lease_owner == token, J.status == "queued", J.phase == "reading")).first()

    def read_done(self, job_id: uuid.UUID, token: str, document: str, layout: bytes | None,
                  warnings: list[str] | None, messages: list[dict[str, Any]] | None = None) -> bool:
        """The files are read: store the text and layout (a chat job: its messages with the files'
        text in place), and leave the job queued for the model (the caller publishes it). False
        when the job was cancelled or deleted meanwhile."""
        values: dict[str, Any] = dict(document=document, layout=layout, warnings=warnings or None, phase=None,
                                      source=None, lease_owner=None, lease_until=None,
                                      published_at=database_now(self.session))
        if messages is not None:
            values["messages"] = messages
        return self.session.execute(
            sa.update(JobRecord).where(J.id == job_id, J.lease_owner == token, J.status == "queued",
                                       J.phase == "reading")
            .values(**values).execution_options(synchronize_session=False)).rowcount == 1

    def read_failed(self, job_id: uuid.UUID, token: str, error: str) -> bool:
        """The file cannot be read: the job fails with `error` (its code first)."""
        _mark_changed(self.session)
        return self.session.execute(
            sa.update(JobRecord).where(J.id == job_id, J.lease_owner == token, J.status == "queued",
                                       J.phase == "reading")
            .values(status="failed", error=error, phase=None, source=None, lease_until=None,
                    finished_at=database_now(self.session), completions=J.completions + 1)
            .execution_options(synchronize_session=False)).rowcount == 1

    def retried(self, ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
        """Those of `ids` on a later attempt (an earlier lease ran out), in `ids` order."""
        if not ids:
            return []
        later = set(self.session.scalars(sa.select(J.id).where(J.id.in_(ids), J.attempts > 1)))
        return [i for i in ids if i in later]

    def renew(self, token: str, lease_s: float) -> int:
        """Extend every lease `token` still holds; returns how many."""
        return self.session.execute(
            sa.update(JobRecord).where(J.lease_owner == token, J.status == "running")
            .values(lease_until=database_now(self.session) + timedelta(seconds=lease_s))
            .execution_options(synchronize_session=False)).rowcount

    def held_ids(self, token: str) -> set[uuid.UUID]:
        """Ids of the jobs `token` still holds (running under its lease)."""
        return set(self.session.scalars(sa.select(J.id).where(J.lease_owner == token, J.status == "running")))

    def held(self, job_id: uuid.UUID, token: str) -> JobRecord | None:
        """The job, if `token` still holds it (not cancelled, not taken over)."""
        return self.session.scalars(sa.select(JobRecord).where(
            J.id == job_id, J.lease_owner == token, J.status == "running")).first()

    def mark_started(self, job_id: uuid.UUID, token: str) -> None:
        now = database_now(self.session)
        job = self.held(job_id, token)
        if job is not None:
            if job.started_at is None:
                job.started_at = now
                job.queued_s = (now - job.created_at).total_seconds()
            self.session.flush()

    def store(self, job_id: uuid.UUID, token: str, *, status: str, result: Any = None,
              error: str | None = None, stats: dict[str, Any] | None = None,
              partial: list[str] | None = None, spans: dict[str, Any] | None = None,
              confidence: dict[str, Any] | None = None, output: str | None = None) -> bool:
        """Finish a held job; False (nothing written) when the lease was lost or it was cancelled.
        `partial`: a chat job's output text, piece by piece (worker/progress.py); `output`: a
        succeeded job's text as the model wrote it (recent_outputs)."""
        values: dict[str, Any] = dict(status=status, result=result, error=error, stats=stats, spans=spans,
                                      confidence=confidence, output=output,
                                      finished_at=database_now(self.session), lease_until=None,
                                      completions=J.completions + 1)
        if stats:
            values.update(prefill_s=stats.get("prefill_s"), decode_s=stats.get("decode_s"))
        if partial is not None:
            values["partial"] = partial
        _mark_changed(self.session)
        return self.session.execute(
            sa.update(JobRecord).where(J.id == job_id, J.lease_owner == token, J.status == "running")
            .values(**values).execution_options(synchronize_session=False)).rowcount == 1

    def recent_outputs(self, tenant: str, schema_id: uuid.UUID, limit: int) -> list[str]:
        """The output texts of the tenant's latest `limit` succeeded jobs of one schema version,
        oldest first (a worker rebuilds the suffix proposer's memory from them)."""
        rows = self.session.scalars(
            sa.select(J.output).where(J.schema_id == schema_id, J.tenant == tenant, J.status == "succeeded",
                                      J.output.is_not(None))
            .order_by(J.finished_at.desc()).limit(limit))
        return list(rows)[::-1]

    def write_partial(self, job_id: uuid.UUID, token: str, pieces: list[str]) -> bool:
        """The output so far of a running streamed job (only by its lease owner)."""
        _mark_changed(self.session)
        return self.session.execute(
            sa.update(JobRecord).where(J.id == job_id, J.lease_owner == token, J.status == "running")
            .values(partial=pieces).execution_options(synchronize_session=False)).rowcount == 1

    def stored_by(self, job_id: uuid.UUID, token: str) -> bool:
        """Whether `token` already stored this job (a store whose commit reply was lost with
        its connection: retrying it must not count as a second result)."""
        return self.session.scalar(sa.select(sa.func.count()).where(
            J.id == job_id, J.lease_owner == token, J.status.in_(TERMINAL_STATUSES), J.completions > 0)) == 1

    def requeue_expired(self, token: str, max_attempts: int, lease_s: float,
                        limit: int = 1000) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
        """Jobs whose lease ran out (their worker died, or lost the database for a whole lease):
        those with attempts left go back to `queued` (to be published again), the others fail
        naming the cause. Returns (re-queued ids, failed ids), tagged with `token` so
        concurrent reapers each act only on what they changed."""
        now = database_now(self.session)
        expired = sa.and_(J.status == "running", J.lease_until < now)
        ids = list(self.session.scalars(sa.select(J.id).where(expired).limit(limit)))
        if not ids:
            return [], []
        _mark_changed(self.session)
        self.session.execute(
            sa.update(JobRecord).where(J.id.in_(ids), expired, J.attempts >= max_attempts)
            .values(status="failed", lease_owner=token, lease_until=None, finished_at=now,
                    completions=J.completions + 1,
                    error=(f"the worker died {max_attempts} times while running this job (each time its lease of "
                           f"{lease_s:g} s ran out with no result: the worker process was killed or crashed, or "
                           "could not reach the database); not run again (STRUCTSPEC_JOB_MAX_ATTEMPTS="
                           f"{max_attempts})"))
            .execution_options(synchronize_session=False))
        self.session.execute(
            sa.update(JobRecord).where(J.id.in_(ids), expired)
            .values(status="queued", lease_owner=token, lease_until=None, published_at=now)
            .execution_options(synchronize_session=False))
        mine = self.session.execute(sa.select(J.id, J.status).where(J.id.in_(ids), J.lease_owner == token)).all()
        return [i for i, st in mine if st == "queued"], [i for i, st in mine if st == "failed"]

    def claim_stranded(self, token: str, older_than_s: float, reading: bool = False,
                       limit: int = 1000) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
        """`queued` jobs whose message went out more than `older_than_s` ago: marked published
        now (tagged with `token`, so of concurrent reapers only one takes each) for the caller
        to publish again before it commits. Returns (first attempts, later attempts): a later
        attempt must go in a message of its own (see `claim`). `reading`: the jobs whose file is
        still to be read instead (for the ingest queue), leaving out those a live reader holds."""
        now = database_now(self.session)
        if reading:
            phase = sa.and_(J.phase == "reading", sa.or_(J.lease_until.is_(None), J.lease_until < now))
        else:
            phase = J.phase.is_(None)
        stale = sa.and_(J.status == "queued", phase, J.published_at < now - timedelta(seconds=older_than_s))
        ids = list(self.session.scalars(sa.select(J.id).where(stale).order_by(J.published_at).limit(limit)))
        if not ids:
            return [], []
        self.session.execute(
            sa.update(JobRecord).where(J.id.in_(ids), stale).values(lease_owner=token, published_at=now)
            .execution_options(synchronize_session=False))
        mine = self.session.execute(sa.select(J.id, J.attempts, J.read_attempts).where(
            J.id.in_(ids), J.lease_owner == token, J.status == "queued")).all()
        if reading:
            return [i for i, _, r in mine if r == 0], [i for i, _, r in mine if r > 0]
        return [i for i, a, _ in mine if a == 0], [i for i, a, _ in mine if a > 0]

    def refs(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[uuid.UUID, uuid.UUID | None]]:
        """{job id: (schema_id, batch_id)} for `ids` (for log lines)."""
        if not ids:
            return {}
        return {i: (s, b) for i, s, b in self.session.execute(
            sa.select(J.id, J.schema_id, J.batch_id).where(J.id.in_(ids)))}

    # --- cancel --------------------------------------------------------------------------------

    def cancel(self, job_id: uuid.UUID) -> bool:
        """queued/running -> cancelled; False when the job is already finished (or absent)."""
        _mark_changed(self.session)
        return self.session.execute(
            sa.update(JobRecord).where(J.id == job_id, J.status.in_(("queued", "running")))
            .values(status="cancelled", finished_at=database_now(self.session), lease_until=None,
                    error="cancelled")
            .execution_options(synchronize_session=False)).rowcount == 1

    def cancel_unfinished_in_batch(self, batch_id: uuid.UUID) -> int:
        """Every queued or running job of the batch -> cancelled, like `cancel` one by one."""
        _mark_changed(self.session)
        return self.session.execute(
            sa.update(JobRecord).where(J.batch_id == batch_id, J.status.in_(("queued", "running")))
            .values(status="cancelled", finished_at=database_now(self.session), lease_until=None,
                    error="cancelled")
            .execution_options(synchronize_session=False)).rowcount

    # --- batch reads ---------------------------------------------------------------------------

    def one_unfinished(self, batch_id: uuid.UUID) -> uuid.UUID | None:
        """The id of one queued or running job of the batch (the last created), or None."""
        return self.session.execute(sa.select(J.id).where(J.batch_id == batch_id, J.status.in_(("queued", "running")))
                                    .order_by(J.created_at.desc(), J.id.desc()).limit(1)).scalar()

    def counts(self, batch_id: uuid.UUID) -> tuple[dict[str, int], datetime | None]:
        """Jobs per status, and the latest finished_at."""
        return self.counts_of([batch_id])[batch_id]

    def counts_of(self, batch_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[dict[str, int], datetime | None]]:
        """{batch id: (jobs per status, the latest finished_at)} for `batch_ids`, in one query."""
        out = {b: ({s: 0 for s in ("queued", "running", *TERMINAL_STATUSES)}, None) for b in batch_ids}
        if not batch_ids:
            return out
        rows = self.session.execute(sa.select(J.batch_id, J.status, sa.func.count(), sa.func.max(J.finished_at))
                                    .where(J.batch_id.in_(batch_ids)).group_by(J.batch_id, J.status)).all()
        for batch_id, status, n, fin in rows:
            counts, latest = out[batch_id]
            counts[status] = n
            if fin is not None and (latest is None or fin > latest):  # max() keeps UTCDateTime
                out[batch_id] = (counts, fin)
        return out

    def truncated_in_batch(self, batch_id: uuid.UUID) -> int:
        """Failed jobs of the batch whose output hit max_tokens or the context (an OpenAI-format
        batch answers those with finish_reason length, not as errors)."""
        return self.session.scalar(sa.select(sa.func.count()).where(
            J.batch_id == batch_id, J.status == "failed", J.error.like("truncated:%")))

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

    def add(self, *, tenant: str, schema_id: uuid.UUID | None, total: int, options: dict[str, Any],
            webhook_url: str | None = None) -> BatchRecord:
        record = BatchRecord(id=uuid.uuid4(), tenant=tenant, schema_id=schema_id, total=total, options=options,
                             created_at=database_now(self.session), webhook_url=webhook_url)
        self.session.add(record)
        self.session.flush()
        return record

    def delete(self, batch_id: uuid.UUID) -> None:
        """Delete the batch and its jobs (see JobRepository.delete_many for running ones)."""
        self.session.execute(sa.delete(JobRecord).where(J.batch_id == batch_id))
        self.session.execute(sa.delete(BatchRecord).where(BatchRecord.id == batch_id))
        _mark_changed(self.session)

    def page(self, tenant: str, *, limit: int, offset: int,
             schema_id: uuid.UUID | None = None) -> tuple[Sequence[BatchRecord], int]:
        """One page of the tenant's batches, newest first, and the total count."""
        return newest_page(self.session, BatchRecord, limit, offset, tenant=tenant, schema_id=schema_id)

    # --- webhooks (worker/webhooks.py) -------------------------------------------------------------

    def webhooks_due(self, max_attempts: int, limit: int) -> list[uuid.UUID]:
        """Batches with an undelivered webhook whose jobs have all finished, not held back (a try
        in flight, or a backoff) and with tries left."""
        B, now = BatchRecord, database_now(self.session)
        return list(self.session.scalars(sa.select(B.id).where(
            B.webhook_url.is_not(None), B.webhook_delivered_at.is_(None), B.webhook_attempts < max_attempts,
            sa.or_(B.webhook_next_at.is_(None), B.webhook_next_at <= now), ~open_jobs(B.id)).limit(limit)))

    def claim_webhook(self, batch_id: uuid.UUID, hold_s: float) -> bool:
        """Take the next try of a due webhook (one reaper of many): counts the try and holds the
        batch back for `hold_s`; False when another reaper took it first."""
        B, now = BatchRecord, database_now(self.session)
        return self.session.execute(
            sa.update(B).where(B.id == batch_id, B.webhook_delivered_at.is_(None),
                               sa.or_(B.webhook_next_at.is_(None), B.webhook_next_at <= now))
            .values(webhook_attempts=B.webhook_attempts + 1, webhook_next_at=now + timedelta(seconds=hold_s))
            .execution_options(synchronize_session=False)).rowcount == 1

    def webhook_done(self, batch_id: uuid.UUID, error: str | None, retry_s: float | None) -> None:
        """Record a try: delivered (error None), or failed with `error`, tried again after
        `retry_s` (None: no try left)."""
        B, now = BatchRecord, database_now(self.session)
        if error is None:
            values: dict[str, Any] = {"webhook_delivered_at": now, "webhook_next_at": None, "webhook_error": None}
        else:
            retry_at = now + timedelta(seconds=retry_s) if retry_s is not None else None
            values = {"webhook_error": error, "webhook_next_at": retry_at}
        self.session.execute(sa.update(B).where(B.id == batch_id).values(**values)
                             .execution_options(synchronize_session=False))

    def openai_batch_of(self, batch_id: uuid.UUID) -> str | None:
        """The id of the OpenAI-format batch whose requests run as this batch's jobs, if any."""
        return self.session.scalar(sa.select(OpenAIBatchRecord.id).where(OpenAIBatchRecord.batch_id == batch_id))

    def finished_before(self, cutoff: datetime, limit: int) -> list[uuid.UUID]:
        """Ids of batches created before `cutoff` whose jobs all finished before it, leaving out
        those behind an OpenAI-format batch (they go with it: openai_batches.py)."""
        B = BatchRecord
        behind_openai = sa.select(OpenAIBatchRecord.id).where(OpenAIBatchRecord.batch_id == B.id)
        return list(self.session.scalars(sa.select(B.id).where(
            B.created_at < cutoff, ~open_jobs(B.id, finished_since=cutoff), ~behind_openai.exists()).limit(limit)))


def open_jobs(batch_id, finished_since: datetime | None = None):
    """EXISTS a job of the batch `batch_id` (a column) that is unfinished, or with
    `finished_since`, finished at or after it: what holds a batch's webhook back (unfinished)
    and keeps it from retention (unfinished or recent)."""
    keeps = [J.status.not_in(TERMINAL_STATUSES)]
    if finished_since is not None:
        keeps += [J.finished_at.is_(None), J.finished_at >= finished_since]
    return sa.select(J.id).where(J.batch_id == batch_id, sa.or_(*keeps)).exists()


def newest_page(session: Session, model, limit: int, offset: int, options: tuple = (), **equal: Any):
    """(one page of `model`'s rows, newest first by (created_at, id), and the total count), of the
    rows whose columns equal the non-None values of `equal`."""
    where = [getattr(model, name) == value for name, value in equal.items() if value is not None]
    total = session.scalar(sa.select(sa.func.count()).select_from(model).where(*where)) or 0
    q = (sa.select(model).where(*where).options(*options)
         .order_by(model.created_at.desc(), model.id.desc()).limit(limit).offset(offset))
    return session.scalars(q).all(), total
