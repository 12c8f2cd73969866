"""ORM models. One table per resource; every change to them needs an Alembic revision."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from structspec.db.columns import UTCDateTime, utcnow

# Deterministic constraint names, so later revisions (and SQLite batch mode) can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class TimestampMixin:
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


# The tenant of everything created without an API key (auth off); keys may be given it.
DEFAULT_TENANT = "default"


def tenant_column() -> Mapped[str]:
    return mapped_column(sa.String(64), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT)


class ApiKeyRecord(Base):
    """An API key: only the SHA-256 of the key is stored. Everything a key creates belongs to
    its tenant; several keys may share one."""

    __tablename__ = "api_keys"

    id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(sa.String(200))
    tenant: Mapped[str] = mapped_column(sa.String(64))
    key_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    prefix: Mapped[str] = mapped_column(sa.String(16))  # the key's first characters, to tell keys apart
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)


class SchemaRecord(TimestampMixin, Base):
    """One version of a registered JSON Schema. Versions count 1, 2, ... per (tenant, name)
    and are never reused, soft-deleted ones included."""

    __tablename__ = "schemas"
    __table_args__ = (
        sa.UniqueConstraint("tenant", "name", "version"),
        sa.Index("ix_schemas_tenant_name_hash", "tenant", "name", "hash"),
    )

    # sa.Uuid: native uuid on PostgreSQL, CHAR(32) on SQLite.
    id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = tenant_column()
    name: Mapped[str] = mapped_column(sa.String(200))
    version: Mapped[int] = mapped_column(sa.Integer)
    # sa.JSON is `json` (not jsonb) on PostgreSQL: key order survives, and property order
    # decides the order the model generates fields in.
    body: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    hash: Mapped[str] = mapped_column(sa.String(64))  # sha256 of canonical JSON (schema_hash)
    description: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)

    def __repr__(self) -> str:
        return f"SchemaRecord(id={self.id}, name={self.name!r}, version={self.version})"


JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")


class BatchRecord(Base):
    """A bulk submission: `total` jobs sharing a schema and options (no schema: an OpenAI-format
    batch, whose requests carry their own). Its counts and status are derived from its jobs
    when read."""

    __tablename__ = "batches"
    __table_args__ = (sa.Index("ix_batches_tenant_created_at", "tenant", "created_at"),)  # GET /v1/batches

    id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = tenant_column()
    schema_id: Mapped[uuid.UUID | None] = mapped_column(sa.Uuid, sa.ForeignKey("schemas.id"), nullable=True)
    total: Mapped[int] = mapped_column(sa.Integer)
    options: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)
    # POSTed once every job has finished (worker/webhooks.py): delivered_at once a 2xx came back;
    # until then each try counts, the next waits until next_at, and the last failure is kept
    webhook_url: Mapped[str | None] = mapped_column(sa.String(2048), nullable=True, default=None)
    webhook_delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)
    webhook_attempts: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    webhook_next_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True, default=None)
    webhook_error: Mapped[str | None] = mapped_column(sa.Text, nullable=True, default=None)


class JobRecord(Base):
    """One extraction. Life cycle: queued -> running -> succeeded | failed, or -> cancelled
    from queued/running. `lease_owner`/`lease_until` fence the worker that claimed it: a result
    is stored only by the current lease owner of a still-running job (see db/jobs.py)."""

    __tablename__ = "jobs"
    __table_args__ = (
        sa.Index("ix_jobs_batch_id_position", "batch_id", "position"),
        sa.Index("ix_jobs_status_lease_until", "status", "lease_until"),
        sa.Index("ix_jobs_finished_at", "finished_at"),  # retention (worker/retention.py)
        sa.Index("ix_jobs_tenant_created_at", "tenant", "created_at"),  # GET /v1/extractions
        sa.Index("ix_jobs_schema_id_finished_at", "schema_id", "finished_at"),  # JobRepository.recent_outputs
    )

    id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True, default=uuid.uuid4)
    tenant: Mapped[str] = tenant_column()
    schema_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, sa.ForeignKey("schemas.id"))
    batch_id: Mapped[uuid.UUID | None] = mapped_column(
        sa.Uuid, sa.ForeignKey("batches.id", ondelete="CASCADE"), nullable=True)
    position: Mapped[int | None] = mapped_column(sa.Integer, nullable=True)  # 0-based, in its batch
    doc_id: Mapped[str | None] = mapped_column(sa.String(200), nullable=True)  # the user's document id
    document: Mapped[str] = mapped_column(sa.Text)
    # where each character of `document` sits on its page, for a document sent as a PDF
    # (structspec.ingest: encode_layout); NULL for text
    layout: Mapped[bytes | None] = mapped_column(sa.LargeBinary, nullable=True, default=None)
    # A document sent as a file is read by a worker (worker/ingest.py), not while the request
    # waits: until then `phase` is "reading", `document` is empty, and `intake["files"]` lists the
    # files to read (one; a chat job's, one per file part), each an uploaded file's id or a slice
    # of `source` (the bytes sent inline, base64), with the media type and name given. Once read,
    # `phase` is NULL, `source` is dropped and `warnings` holds what reading had to say (a page
    # rendered at a lower resolution to fit a limit ...).
    phase: Mapped[str | None] = mapped_column(sa.String(16), nullable=True, default=None)
    source: Mapped[bytes | None] = mapped_column(sa.LargeBinary, nullable=True, default=None)
    intake: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, nullable=True, default=None)
    warnings: Mapped[list[str] | None] = mapped_column(sa.JSON, nullable=True, default=None)
    # reading attempts: a reading process that died this many times (a file that crashes or
    # exhausts it) fails the job instead of being read again (STRUCTSPEC_JOB_MAX_ATTEMPTS)
    read_attempts: Mapped[int] = mapped_column(sa.Integer, default=0, server_default="0")
    # chat messages [{role, content}] of an OpenAI-compatible request: the prompt is these through
    # the model's chat template, and `document` holds their text; NULL for extraction jobs
    messages: Mapped[list[dict[str, str]] | None] = mapped_column(sa.JSON, nullable=True)
    # the output text of a chat job as it was generated, one piece per target pass that added
    # text: written with the result, and while it runs when `stream` is set (streamed replies)
    partial: Mapped[list[str] | None] = mapped_column(sa.JSON, nullable=True)
    stream: Mapped[bool] = mapped_column(sa.Boolean, default=False, server_default=sa.false())
    options: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    status: Mapped[str] = mapped_column(sa.String(16), default="queued")
    result: Mapped[Any | None] = mapped_column(sa.JSON, nullable=True)
    # a succeeded job's output text as the model wrote it (the suffix proposer's memory; migration 0017)
    output: Mapped[str | None] = mapped_column(sa.Text, nullable=True, default=None)
    error: Mapped[str | None] = mapped_column(sa.Text, nullable=True)
    stats: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, nullable=True)
    # a succeeded result's grounding by JSON Pointer (engine/grounding.py): each string's
    # [start, end) in the document or null; each leaf's token probabilities {min, mean}
    spans: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, nullable=True)
    confidence: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON, nullable=True)
    queued_s: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    prefill_s: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    decode_s: Mapped[float | None] = mapped_column(sa.Float, nullable=True)
    attempts: Mapped[int] = mapped_column(sa.Integer, default=0)
    completions: Mapped[int] = mapped_column(sa.Integer, default=0)  # results stored; 1 when finished once
    lease_owner: Mapped[str | None] = mapped_column(sa.String(64), nullable=True)
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    # when a message for it was last published (submit, reaper); a `queued` job whose message
    # is long out while the broker's queue is empty is published again (worker/tasks.py)
    published_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


class IdempotencyKeyRecord(Base):
    """A submission's Idempotency-Key (POST /v1/extractions, POST /v1/batches): the request's
    fingerprint and the answer it got, replayed to a repeat of the request for a day
    (db/idempotency.py). Written in the transaction that stores the jobs."""

    __tablename__ = "idempotency_keys"

    tenant: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    key: Mapped[str] = mapped_column(sa.String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(sa.String(64))  # sha256 of the route and the request
    response: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


# --- the OpenAI-compatible Files and Batches (structspec/api/openai.py) ----------------------

class FileRecord(Base):
    """A file: uploaded (POST /v1/files, or the OpenAI surface's; purpose `user_data`: a document
    to extract from, `batch`: an OpenAI-format batch's input) or written by the service (purpose
    `batch_output`). Its bytes are in `file_parts`, so that neither an upload nor a read holds a
    whole file in memory (db/files.py). Ids look like OpenAI's: `file-<hex>`."""

    __tablename__ = "files"
    __table_args__ = (sa.Index("ix_files_tenant_created_at", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    tenant: Mapped[str] = tenant_column()
    purpose: Mapped[str] = mapped_column(sa.String(32))
    filename: Mapped[str] = mapped_column(sa.String(255))
    bytes: Mapped[int] = mapped_column(sa.Integer)
    media_type: Mapped[str | None] = mapped_column(sa.String(200), nullable=True, default=None)  # as uploaded
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class FilePartRecord(Base):
    """One piece of a file's bytes, in order (`seq` from 0); deleted with its file."""

    __tablename__ = "file_parts"

    file_id: Mapped[str] = mapped_column(sa.String(40), sa.ForeignKey("files.id", ondelete="CASCADE"),
                                         primary_key=True)
    seq: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(sa.LargeBinary)


OPENAI_BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                         "cancelling", "cancelled")


class OpenAIBatchRecord(Base):
    """A batch in OpenAI's Batch format: its requests run as the jobs of `batch_id` (a
    structspec batch with no schema), `position` their input line order and `doc_id` their
    custom_id. `invalid` keeps the input lines refused at validation, for the error file."""

    __tablename__ = "openai_batches"
    __table_args__ = (sa.Index("ix_openai_batches_tenant_created_at", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(sa.String(40), primary_key=True)
    tenant: Mapped[str] = tenant_column()
    batch_id: Mapped[uuid.UUID | None] = mapped_column(
        sa.Uuid, sa.ForeignKey("batches.id", ondelete="SET NULL"), nullable=True)
    input_file_id: Mapped[str] = mapped_column(sa.String(40))
    endpoint: Mapped[str] = mapped_column(sa.String(64))
    completion_window: Mapped[str] = mapped_column(sa.String(16))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", sa.JSON, nullable=True)
    status: Mapped[str] = mapped_column(sa.String(16))
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(sa.JSON, nullable=True)
    total: Mapped[int] = mapped_column(sa.Integer, default=0)
    invalid: Mapped[list[dict[str, Any]]] = mapped_column(sa.JSON)
    output_file_id: Mapped[str | None] = mapped_column(sa.String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(sa.String(40), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    in_progress_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)


# --- acceptance statistics (structspec/stats) -------------------------------------------------

class ArmStatsRecord(Base):
    """Aggregated engine stats of one (schema, strategy, draft_len): one row per key, updated
    in the worker's result transaction. Exact totals feed the API and /metrics; the `d_*`
    columns are decayed counts (as of the schema's request clock `seen_at`) for the selector."""

    __tablename__ = "schema_arm_stats"

    schema_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, sa.ForeignKey("schemas.id", ondelete="CASCADE"),
                                                 primary_key=True)
    strategy: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    draft_len: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    requests: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    target_passes: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    proposed: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    accepted: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    decode_s: Mapped[float] = mapped_column(sa.Float, default=0.0)
    latency_s_sum: Mapped[float] = mapped_column(sa.Float, default=0.0)
    latency_buckets: Mapped[list[int]] = mapped_column(sa.JSON)  # per stats.aggregate.LATENCY_BUCKETS, +Inf last
    d_requests: Mapped[float] = mapped_column(sa.Float, default=0.0)
    d_passes: Mapped[float] = mapped_column(sa.Float, default=0.0)
    d_decode_s: Mapped[float] = mapped_column(sa.Float, default=0.0)
    seen_at: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    # sum over requests of the job's mean batch size (sequences decoded together per step)
    batch_size_sum: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class PositionStatsRecord(Base):
    """Per draft position i of one arm: passes in which position i was proposed / accepted
    (accepted at i implies accepted at 0..i-1) / reached (offered, with 0..i-1 accepted: the
    selector's trials of position i), exact and decayed."""

    __tablename__ = "schema_position_stats"
    __table_args__ = (
        sa.ForeignKeyConstraint(["schema_id", "strategy", "draft_len"],
                                ["schema_arm_stats.schema_id", "schema_arm_stats.strategy",
                                 "schema_arm_stats.draft_len"], ondelete="CASCADE"),
    )

    schema_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, primary_key=True)
    strategy: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    draft_len: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    position: Mapped[int] = mapped_column(sa.Integer, primary_key=True)
    proposed: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    accepted: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    d_accepted: Mapped[float] = mapped_column(sa.Float, default=0.0)
    reached: Mapped[int] = mapped_column(sa.BigInteger, default=0, server_default="0")
    d_reached: Mapped[float] = mapped_column(sa.Float, default=0.0, server_default="0")


class StrategyPinRecord(Base):
    """A strategy pinned for one schema version: `auto` jobs of it use this, not the selector."""

    __tablename__ = "schema_strategy_pins"

    schema_id: Mapped[uuid.UUID] = mapped_column(sa.Uuid, sa.ForeignKey("schemas.id", ondelete="CASCADE"),
                                                 primary_key=True)
    strategy: Mapped[str] = mapped_column(sa.String(16))
    draft_len: Mapped[int] = mapped_column(sa.Integer)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
