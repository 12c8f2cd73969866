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
at each try: the host name is resolved once, every address it resolves to is checked, and the
POST connects to a checked address (the first, or the next where a connection cannot be made),
with the URL's host in the Host header and, for https, in TLS's SNI and as the name the server's
certificate must carry. Nothing resolves the name a second time, so an answer that changes in
between (DNS rebinding) cannot reach another address. A refused address is a failed try, with
the reason kept, and nothing is sent. Redirects are not followed (a 3xx is a failed try), and
proxy settings from the environment are not used: a proxy would resolve the name itself.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import ssl
import uuid
from typing import Callable
from urllib.parse import urlsplit

import httpx
import msgspec

from structspec.config import Settings
from structspec.db.jobs import BatchRepository, JobRepository
from structspec.logs import clip
from structspec.services.batches import to_batch_read
from structspec.services.webhooks import ascii_host, vetted_addresses

log = logging.getLogger("structspec.worker")

MAX_ATTEMPTS = 8
TIMEOUT_S = 10.0
HOLD_S = 60.0  # a claimed try holds its batch back this long: more than a try can take
# addresses tried in one try when connecting fails (an IPv6 and an IPv4 answer): each connection,
# write and read gets TIMEOUT_S, so 2 connects + write + read stay within HOLD_S
MAX_ADDRESSES = 2
# what a receiver's certificate is verified against: True = the system's CAs (an SSLContext in tests)
TLS_VERIFY: bool | ssl.SSLContext = True
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
    """One round: try every due webhook (up to `limit`); returns how many were delivered.
    `post(url, content=, headers=, timeout=, follow_redirects=, extensions=)` sends one request
    (default: `send`)."""
    post = post or send
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
        # resolved once, here: a name may resolve elsewhere than at submission, or than a moment ago
        addresses, refused = vetted_addresses(url, settings.webhook_hosts)
        error = refused or _post(post, url, addresses, body, settings.webhook_secret)
        retry = None if error is None else retry_after(attempts)
        with sessions.begin() as session:
            BatchRepository(session).webhook_done(batch_id, error, retry)
        _log(batch_id, attempts, error, retry)
        delivered += error is None
    return delivered


def send(url: str, **kwargs) -> httpx.Response:
    """One POST with a client of its own: no proxy from the environment, certificates verified
    against TLS_VERIFY."""
    with httpx.Client(verify=TLS_VERIFY, trust_env=False) as client:
        return client.post(url, **kwargs)


def _post(post, url: str, addresses: list[str], body: bytes, secret: str) -> str | None:
    """POST `body` to `url` over a connection to one of `addresses` (vetted); None when it
    answered 2xx, else why not (one line)."""
    parts = urlsplit(url)
    host = ascii_host(parts.hostname.lower())
    shown = f"[{host}]" if ":" in host else host
    headers = {"content-type": "application/json", "user-agent": "structspec-webhook",
               "host": shown if parts.port is None else f"{shown}:{parts.port}"}
    if secret:
        headers["structspec-signature"] = signature(secret, body)
    # https: SNI and the certificate check are for the URL's host, not the address connected to
    extensions = {"sni_hostname": host} if parts.scheme == "https" and not _is_address(host) else {}
    tried = addresses[:MAX_ADDRESSES]
    for i, address in enumerate(tried):
        pinned = str(httpx.URL(url).copy_with(host=address))
        try:
            r = post(pinned, content=body, headers=headers, timeout=TIMEOUT_S, follow_redirects=False,
                     extensions=extensions)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            if i + 1 < len(tried):
                continue  # no connection, nothing sent: the next vetted address
            return f"{type(e).__name__}: {clip(e, 200)} (connecting to {address})"
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {clip(e, 200)}"
        if 200 <= r.status_code < 300:
            return None
        return f"HTTP {r.status_code}: {clip(r.text, 200)}"
    raise AssertionError("vetted_addresses returns at least one address")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _log(batch_id: uuid.UUID, attempts: int, error: str | None, retry: float | None) -> None:
    fields = {"batch_id": str(batch_id), "attempt": attempts}
    if error is None:
        log.info("batch webhook delivered", extra=fields)
    elif retry is not None:
        log.warning("batch webhook failed (%s); next try in %g s", error, retry, extra=fields)
    else:
        log.error("batch webhook failed (%s); no try left after %d", error, attempts, extra=fields)
