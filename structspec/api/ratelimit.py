"""Per-client request rate limit, and failed authentication per client address, on /v1 routes:
token buckets in this process.

Requests. A client is an API key that has authenticated in this process (its canonical form,
as auth reads it: `Bearer` in any case, white space stripped, so every spelling of one key is
one client, from any address), else the client's IP address as the socket reports it (no
forwarding headers are trusted). A key gets its bucket only once auth has accepted it
(api/auth.py calls `admit`): until then, and for every key auth refuses, requests count against
their address, so made-up keys cannot each open a fresh bucket. Each bucket holds at most
`rate_limit_burst` tokens and refills at `rate_limit_per_minute / 60` per second; a request
takes one, and one that finds none gets 429 with `Retry-After` (whole seconds until a token is
back). `rate_limit_per_minute = 0` turns it off.

Failed authentication. Every request whose Authorization header auth refuses (malformed,
unknown or revoked key) takes a token from its address's failure bucket (`auth_failure_burst`,
refilled at `auth_failures_per_minute`; an IPv6 address counts by its /64 network, which one
host usually holds whole). While that bucket is empty, every /v1 request from the address is
429, a correct key included, before any key is looked up: the check costs no database query,
and a guesser learns nothing from answers it cannot get. `auth_failures_per_minute = 0` turns
it off.

The buckets live in the API process: with N processes (uvicorn workers, replicas) a client
gets up to N times the rate. /health, /metrics and the OpenAPI document (/schema) are exempt.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import threading
import time
from collections import OrderedDict
from typing import Callable

from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Receive, Scope, Send

from structspec.api.errors import ErrorBody, ErrorItem
from structspec.services.keys import bearer_key, hash_key

LIMITED_PREFIXES = ("/v1", "/openai/v1")  # structspec's API and the OpenAI-compatible surface
MAX_CLIENTS = 100_000  # buckets kept; the least recently seen is dropped (it comes back full)


class RateLimiter:
    """Token buckets keyed by client identity. `clock` (monotonic seconds) is injectable.
    `settings` names the two settings behind it, for the 429's message."""

    def __init__(self, per_minute: int, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_CLIENTS, settings: str = "rate_limit_per_minute, rate_limit_burst"):
        self.per_minute = per_minute
        self.settings = settings
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
        if not self.enabled:
            return 0.0
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

    def wait(self, key: str) -> float:
        """The seconds until `key` has a token (0.0: it has one now), taking nothing."""
        if not self.enabled:
            return 0.0
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - at) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._buckets

    def admit(self, key: str) -> None:
        """Give `key` a bucket (full) unless it has one."""
        if not self.enabled:
            return
        now = self.clock()
        with self._lock:
            if key not in self._buckets:
                self._buckets[key] = (float(self.burst), now)
                while len(self._buckets) > self.max_clients:
                    self._buckets.popitem(last=False)


def key_identity(key: str) -> str:
    """The request bucket of an API key (canonical, as `bearer_key` returns it)."""
    return "key:" + hash_key(key)


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return client[0] if client else "unknown"


def client_identity(scope: Scope, limiter: RateLimiter) -> str:
    """The bucket a request is metered in: its key's, once that key has authenticated (it has a
    bucket in `limiter`), else `ip:<client address>`."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            key = bearer_key(value.decode("latin-1"))
            if key is not None and limiter.has(identity := key_identity(key)):
                return identity
            break
    return "ip:" + client_address(scope)


def failure_identity(scope: Scope) -> str:
    """The failure bucket of a request's address: the address, or for IPv6 its /64 network."""
    address = client_address(scope)
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return "ip:" + address
    if ip.version == 6:
        if ip.ipv4_mapped:
            return "ip:" + str(ip.ipv4_mapped)
        return "net:" + str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return "ip:" + str(ip)


def is_limited(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in LIMITED_PREFIXES)


class RateLimitMiddleware(ASGIMiddleware):
    """429 before auth (no key is looked up) and before the body is read: for an address over
    its failed-authentication budget, and for a client over its request rate."""

    def __init__(self, limiter: RateLimiter, failures: RateLimiter | None = None):
        self.limiter = limiter
        self.failures = failures

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        if scope["type"] != "http" or not is_limited(scope.get("path", "")):
            await next_app(scope, receive, send)
            return
        if self.failures is not None and self.failures.enabled:
            wait = self.failures.wait(failure_identity(scope))
            if wait:
                await send_too_many(send, self.failures, wait, scope.get("path", ""), auth_failures=True)
                return
        if self.limiter.enabled:
            wait = self.limiter.take(client_identity(scope, self.limiter))
            if wait:
                await send_too_many(send, self.limiter, wait, scope.get("path", ""))
                return
        await next_app(scope, receive, send)


async def send_too_many(send: Send, limiter: RateLimiter, wait: float, path: str = "",
                        auth_failures: bool = False) -> None:
    import msgspec

    from structspec.api.openai import PREFIX as OPENAI_PREFIX, error_body

    retry_after = max(1, math.ceil(wait))
    if auth_failures:
        limit = f"{limiter.per_minute} failed authentications per minute, bursts of {limiter.burst}"
        detail = (f"too many failed authentications from this address: the limit is {limit} ({limiter.settings}); "
                  f"every request from it is refused until then, whatever its key; retry after {retry_after} s")
        source = "auth_failures"
    else:
        limit = f"{limiter.per_minute} requests per minute, bursts of {limiter.burst}"
        detail = (f"too many requests: the limit is {limit} per client ({limiter.settings}); "
                  f"retry after {retry_after} s")
        source = "rate_limit"
    if path.startswith(OPENAI_PREFIX + "/"):
        body = msgspec.json.encode(error_body(429, detail, code="rate_limit_exceeded"))
    else:
        body = msgspec.json.encode(ErrorBody(status_code=429, detail=detail,
                                             errors=[ErrorItem(message=f"over {limit}", source=source)]))
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(retry_after).encode())]})
    await send({"type": "http.response.body", "body": body})
