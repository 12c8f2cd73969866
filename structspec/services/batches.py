"""A batch as clients see it: its counts by job status, the status those make, its webhook's
state. The API answers GET /v1/batches/{id} with it and the worker's webhook carries the same
value, so both take it from here (the worker never imports the HTTP layer)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated

import msgspec

from structspec.db.models import BatchRecord


class BatchCounts(msgspec.Struct, kw_only=True):
    queued: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0


class BatchWebhook(msgspec.Struct, kw_only=True):
    url: str
    delivered_at: Annotated[datetime | None, msgspec.Meta(description="when the URL answered 2xx")]
    attempts: int
    error: Annotated[str | None, msgspec.Meta(description="the last failed try's reason")]


class BatchRead(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    schema_id: Annotated[uuid.UUID | None, msgspec.Meta(
        description="null for a batch submitted in OpenAI's Batch format, whose requests carry their own schemas")]
    total: int
    counts: BatchCounts
    status: Annotated[str, msgspec.Meta(
        description="queued | running | succeeded | failed | cancelled | partial (see docs/api.md)")]
    created_at: datetime
    finished_at: datetime | None
    webhook: BatchWebhook | None = None



def batch_status(counts: dict[str, int], cancelled: bool) -> str:
    """queued: nothing started; running: some not finished; once all are finished: cancelled if
    the batch was cancelled, succeeded/failed if all did, otherwise partial."""
    total = sum(counts.values())
    if counts["queued"] == total:
        return "queued"
    if counts["queued"] or counts["running"]:
        return "running"
    if cancelled and counts["cancelled"]:
        return "cancelled"
    for s in ("succeeded", "failed", "cancelled"):
        if counts[s] == total:
            return s
    return "partial"


def to_batch_read(b: BatchRecord, counts: dict[str, int], latest) -> BatchRead:
    status = batch_status(counts, b.cancelled_at is not None)
    done = status not in ("queued", "running")
    webhook = None if b.webhook_url is None else BatchWebhook(
        url=b.webhook_url, delivered_at=b.webhook_delivered_at, attempts=b.webhook_attempts, error=b.webhook_error)
    return BatchRead(id=b.id, schema_id=b.schema_id, total=b.total, counts=BatchCounts(**counts), status=status,
                     created_at=b.created_at, finished_at=latest if done else None, webhook=webhook)
