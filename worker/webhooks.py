"""Batch webhooks: once every job of a batch submitted with a webhook_url has finished, the URL
gets one POST (at least once; a retried delivery carries the same delivery id).

Every worker's reaper round calls `deliver_webhooks` (worker/tasks.py, Reaper): it claims due
batches with a conditional UPDATE (so of several workers one tries each), POSTs, and records
the outcome. A 2xx answer delivers it. Anything else (another status, a timeout, a refused
connection) is retried after 30 s, 1, 2, 4 ... minutes (at most an hour), MAX_ATTEMPTS tries in
all; the last failure is kept, and shown by GET /v1/batches/{id} under `webhook`. A worker that
dies mid-try leaves the batch held back for HOLD_S, then it is tried again.

The body is JSON: {"type": "batch.finished", "delivery": "<batch id>", "batch": <what
GET /v1/batches/{id} answers>, "results_url": "/v1/batches/<id>/results"}. With
STRUCTSPEC_WEBHOOK_SECRET set, the header `Structspec-Signature: sha256=<hex>` is the
HMAC-SHA256 of the raw body under that secret. Which hosts may be called
(STRUCTSPEC_WEBHOOK_HOSTS, structspec/services/webhooks.py) is checked at submission and again
before each try, on the addresses the host resolves to then; a refused address is a failed
try, with the reason kept, and nothing is sent to it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import uuid
from typing import Callable

import httpx
import msgspec

from structspec.config import Settings
from structspec.db.jobs import BatchRepository, JobRepository
from structspec.logs import preview
from structspec.services.batches import to_batch_read
from structspec.services.webhooks import address_problem

log = logging.getLogger("structspec.worker")

MAX_ATTEMPTS = 8
TIMEOUT_S = 10.0
HOLD_S = 60.0  # a claimed try holds its batch back this long: more than a try can take
FIRST_RETRY_S = 30.0
MAX_RETRY_S = 3600.0


def retry_after(attempts: int) -> float | None:
    """Seconds before the next try after `attempts` failed ones (None: no try left)."""
    if attempts >= MAX_ATTEMPTS:
        return None
    return min(FIRST_RETRY_S * 2 ** (attempts - 1), MAX_RETRY_S)


def signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def deliver_webhooks(settings: Settings, sessions, post: Callable[..., httpx.Response] | None = None,
                     limit: int = 20) -> int:
    """One round: try every due webhook (up to `limit`); returns how many were delivered."""
    post = post or httpx.post
    with sessions() as session:
        due = BatchRepository(session).webhooks_due(MAX_ATTEMPTS, limit)
    delivered = 0
    for batch_id in due:
        with sessions.begin() as session:
            repo = BatchRepository(session)
            if not repo.claim_webhook(batch_id, HOLD_S):
                continue  # another worker's round took it
            batch = repo.get(batch_id)
            url, attempts = batch.webhook_url, batch.webhook_attempts
            read = to_batch_read(batch, *JobRepository(session).counts(batch_id))
        body = msgspec.json.encode({"type": "batch.finished", "delivery": str(batch_id), "batch": read,
                                    "results_url": f"/v1/batches/{batch_id}/results"})
        refused = address_problem(url, settings.webhook_hosts)  # a name may resolve elsewhere than at submission
        error = refused or _post(post, url, body, settings.webhook_secret)
        retry = None if error is None else retry_after(attempts)
        with sessions.begin() as session:
            BatchRepository(session).webhook_done(batch_id, error, retry)
        _log(batch_id, attempts, error, retry)
        delivered += error is None
    return delivered


def _post(post, url: str, body: bytes, secret: str) -> str | None:
    """None when the URL answered 2xx, else why not (one line)."""
    headers = {"content-type": "application/json", "user-agent": "structspec-webhook"}
    if secret:
        headers["structspec-signature"] = signature(secret, body)
    try:
        r = post(url, content=body, headers=headers, timeout=TIMEOUT_S, follow_redirects=False)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {preview(e, 200)}"
    if 200 <= r.status_code < 300:
        return None
    return f"HTTP {r.status_code}: {preview(r.text, 200)}"


def _log(batch_id: uuid.UUID, attempts: int, error: str | None, retry: float | None) -> None:
    fields = {"batch_id": str(batch_id), "attempt": attempts}
    if error is None:
        log.info("batch webhook delivered", extra=fields)
    elif retry is not None:
        log.warning("batch webhook failed (%s); next try in %g s", error, retry, extra=fields)
    else:
        log.error("batch webhook failed (%s); no try left after %d", error, attempts, extra=fields)
