"""Per-client request rate limit on /v1 routes: a token bucket per identity, in this process.

Identity: the SHA-256 of the `Authorization` header value when the request has one (so one
API key is one client, whatever address it comes from), else the client's IP address as the
socket reports it (no forwarding headers are trusted). Each bucket holds at most
`rate_limit_burst` tokens and refills at `rate_limit_per_minute / 60` per second; a request
takes one token, and one that finds none gets 429 with `Retry-After` (whole seconds until a
token is back). `rate_limit_per_minute = 0` turns it off.

The buckets live in the API process: with N processes (uvicorn workers, replicas) a client
gets up to N times the rate. /health, /metrics and the OpenAPI document (/schema) are exempt.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from typing import Callable

from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

from structspec.api.errors import ErrorBody, ErrorItem

LIMITED_PREFIXES = ("/v1", "/openai/v1")  # structspec's API and the OpenAI-compatible surface
MAX_CLIENTS = 100_000  # buckets kept; the least recently seen is dropped (it comes back full)


class RateLimiter:
    """Token buckets keyed by client identity. `clock` (monotonic seconds) is injectable."""

    def __init__(self, per_minute: int, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_CLIENTS):
        self.per_minute = per_minute
        self.rate = per_minute / 60.0  # tokens per second
        self.burst = max(1, burst)
        self.clock = clock
        self.max_clients = max_clients
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.per_minute > 0

    def take(self, key: str) -> float:
        """Take one token for `key`: 0.0 if allowed, else the seconds until one is available."""
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
            if tokens >= 1.0:
                tokens -= 1.0
                wait = 0.0
            else:
                wait = (1.0 - tokens) / self.rate
            self._buckets[key] = (tokens, now)  # most recently seen last
            while len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
            return wait


def client_identity(scope: Scope) -> str:
    """`key:<sha256 of the Authorization value>` when present, else `ip:<client address>`."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization" and value:
            return "key:" + hashlib.sha256(value).hexdigest()
    client = scope.get("client")
    return f"ip:{client[0] if client else 'unknown'}"


def is_limited(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in LIMITED_PREFIXES)


class RateLimitMiddleware(ASGIMiddleware):
    """429 before the handler (and before the body is read) for a client over its rate."""

    def __init__(self, limiter: RateLimiter):
        self.limiter = limiter

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        if scope["type"] != "http" or not self.limiter.enabled or not is_limited(scope.get("path", "")):
            await next_app(scope, receive, send)
            return
        wait = self.limiter.take(client_identity(scope))
        if not wait:
            await next_app(scope, receive, send)
            return
        await send_too_many(send, self.limiter, wait, scope.get("path", ""))


async def send_too_many(send: Send, limiter: RateLimiter, wait: float, path: str = "") -> None:
    import msgspec

    from structspec.api.openai import PREFIX as OPENAI_PREFIX, error_body

    retry_after = max(1, math.ceil(wait))
    limit = f"{limiter.per_minute} requests per minute, bursts of {limiter.burst}"
    detail = (f"too many requests: the limit is {limit} per client (rate_limit_per_minute, "
              f"rate_limit_burst); retry after {retry_after} s")
    if path.startswith(OPENAI_PREFIX + "/"):
        body = msgspec.json.encode(error_body(429, detail, code="rate_limit_exceeded"))
    else:
        body = msgspec.json.encode(ErrorBody(status_code=429, detail=detail,
                                             errors=[ErrorItem(message=f"over {limit}", source="rate_limit")]))
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(retry_after).encode())]})
    await send({"type": "http.response.body", "body": body})
