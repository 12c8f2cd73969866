"""The token bucket behind the per-client rate limit (structspec/api/ratelimit.py)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from structspec.api.ratelimit import (RateLimiter, client_identity, failure_identity, is_limited,  # noqa: E402
                                      key_identity)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refusal_with_the_wait_until_the_next_token():
    clock = Clock()
    limiter = RateLimiter(per_minute=60, burst=3, clock=clock)  # 1 token per second
    assert [limiter.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("a") == 1.0
    clock.now += 0.25
    assert limiter.take("a") == 0.75  # a refused request takes nothing


def test_tokens_refill_at_the_rate_up_to_the_burst():
    clock = Clock()
    limiter = RateLimiter(per_minute=120, burst=2, clock=clock)  # 2 tokens per second
    assert [limiter.take("a") for _ in range(2)] == [0.0, 0.0]
    assert limiter.take("a") > 0
    clock.now += 0.5
    assert limiter.take("a") == 0.0 and limiter.take("a") > 0
    clock.now += 3600  # a long pause refills to the burst, not beyond
    assert [limiter.take("a") for _ in range(3)][-1] > 0


def test_identities_are_independent():
    limiter = RateLimiter(per_minute=60, burst=1, clock=Clock())
    assert limiter.take("a") == 0.0 and limiter.take("a") > 0
    assert limiter.take("b") == 0.0


def test_buckets_are_bounded_and_an_evicted_client_comes_back_full():
    limiter = RateLimiter(per_minute=60, burst=1, clock=Clock(), max_clients=2)
    for key in ("a", "b", "c"):
        assert limiter.take(key) == 0.0
    assert len(limiter._buckets) == 2
    assert limiter.take("a") == 0.0  # "a" was the least recently seen: dropped


def test_zero_per_minute_is_off():
    assert not RateLimiter(per_minute=0, burst=10).enabled


def test_identity_is_an_admitted_keys_canonical_hash_else_the_client_ip():
    limiter = RateLimiter(per_minute=60, burst=1, clock=Clock())
    with_key = {"headers": [(b"authorization", b"Bearer k1")], "client": ("10.0.0.1", 5)}
    same_key_elsewhere = {"headers": [(b"Authorization", b"  bearer   k1 ")], "client": ("10.0.0.2", 6)}
    other_key = {"headers": [(b"authorization", b"Bearer k2")], "client": ("10.0.0.1", 5)}
    anonymous = {"headers": [], "client": ("10.0.0.1", 7)}
    # a key auth has not accepted (yet) is metered by its address
    assert client_identity(with_key, limiter) == client_identity(anonymous, limiter) == "ip:10.0.0.1"
    limiter.admit(key_identity("k1"))
    assert client_identity(with_key, limiter) == client_identity(same_key_elsewhere, limiter) == key_identity("k1")
    assert key_identity("k1").startswith("key:") and "k1" not in key_identity("k1")
    assert client_identity(other_key, limiter) == "ip:10.0.0.1"


def test_wait_takes_nothing_and_admit_gives_a_full_bucket_once():
    clock = Clock()
    limiter = RateLimiter(per_minute=60, burst=2, clock=clock)
    assert limiter.wait("a") == 0.0 and not limiter.has("a")  # looking creates no bucket
    assert limiter.take("a") == 0.0 and limiter.take("a") == 0.0
    assert limiter.wait("a") == limiter.wait("a") == 1.0
    limiter.admit("a")  # an existing bucket is left as it is
    assert limiter.take("a") == 1.0
    limiter.admit("b")
    assert limiter.has("b") and [limiter.take("b") for _ in range(3)] == [0.0, 0.0, 1.0]


def test_failures_count_by_address_and_an_ipv6_client_by_its_64():
    def scope(address):
        return {"client": (address, 1)}

    assert failure_identity(scope("10.0.0.1")) == "ip:10.0.0.1"
    assert failure_identity(scope("::ffff:10.0.0.1")) == "ip:10.0.0.1"
    assert failure_identity(scope("2001:db8::1")) == failure_identity(scope("2001:db8::ffff:1")) == "net:2001:db8::/64"
    assert failure_identity(scope("2001:db8:0:1::1")) != failure_identity(scope("2001:db8::1"))
    assert failure_identity({}) == "ip:unknown"


def test_only_v1_paths_are_limited():
    assert is_limited("/v1/schemas") and is_limited("/v1")
    assert not any(is_limited(p) for p in ("/health", "/metrics", "/schema/openapi.json", "/v10", "/v1x"))
