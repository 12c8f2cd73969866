"""The service's limits over HTTP: each refusal is a 413/422/429 in the API's error shape that
names the limit and its setting (docs/api.md#limits)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
from litestar.testing import TestClient

from integration_helpers import assert_error
from structspec.api.app import create_app


# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def limited(settings):
    """An app allowing 60 requests a minute in bursts of 3, on a clock the test moves."""
    clock = Clock()
    app = create_app(replace(settings, rate_limit_per_minute=60, rate_limit_burst=3))
    app.state.rate_limiter.clock = clock
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, clock


# --- request rate ------------------------------------------------------------------------------

def test_burst_over_the_limit_is_429_with_retry_after_naming_the_setting(limited):
    client, clock = limited
    assert [client.get("/v1/schemas").status_code for _ in range(3)] == [200, 200, 200]
    r = client.get("/v1/schemas")
    body = assert_error(r, 429)
    assert r.headers["retry-after"] == "1"
    assert "rate_limit_per_minute" in body["detail"] and "60 requests per minute" in body["detail"]
    assert body["errors"][0]["source"] == "rate_limit"
    clock.now += 0.2  # 0.8 s still to wait: rounded up
    assert client.post("/v1/schemas", json={"name": "x", "schema": {}}).headers["retry-after"] == "1"


def test_the_openai_surface_shares_the_limit_and_answers_429_in_its_own_shape(limited):
    client, _ = limited
    assert [client.get("/openai/v1/models").status_code for _ in range(3)] == [200, 200, 200]
    r = client.get("/openai/v1/models")
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "rate_limit_per_minute" in error["message"]
    assert client.get("/v1/schemas").status_code == 429  # one bucket per client for both surfaces


def test_tokens_refill_with_time(limited):
    client, clock = limited
    for _ in range(3):
        client.get("/v1/schemas")
    assert client.get("/v1/schemas").status_code == 429
    clock.now += 1.0
    assert client.get("/v1/schemas").status_code == 200
    assert client.get("/v1/schemas").status_code == 429
    clock.now += 120
    assert [client.get("/v1/schemas").status_code for _ in range(4)] == [200, 200, 200, 429]


def test_each_key_has_its_own_bucket(limited):
    from structspec.services.keys import create_key

    client, _ = limited
    one, two = (create_key(client.app.state.session_factory, name, name)[1] for name in ("one", "two"))
    # a key's first request counts against its address (until auth accepts it, a key is a guess);
    # then the key has its own bucket of 3
    for _ in range(4):
        assert client.get("/v1/schemas", headers={"authorization": f"Bearer {one}"}).status_code == 200
    assert client.get("/v1/schemas", headers={"authorization": f"Bearer {one}"}).status_code == 429
    assert client.get("/v1/schemas", headers={"authorization": f"Bearer {two}"}).status_code == 200
    # no header: the address's bucket (one token left), then auth refuses it (keys exist)
    assert client.get("/v1/schemas").status_code == 401
    assert client.get("/v1/schemas").status_code == 429


def test_every_spelling_of_one_key_shares_its_bucket(limited):
    """The bucket is the key as auth reads it: the scheme's case and white space around either
    part do not make a new client."""
    from structspec.services.keys import create_key

    client, _ = limited
    key = create_key(client.app.state.session_factory, "k", "k")[1]
    spellings = [f"Bearer {key}", f"bearer   {key} ", f"  BEARER {key}", f"BeArEr {key}\t", f"bearer {key}"]
    # the first on the address, then 3 on the key's bucket
    assert [client.get("/v1/schemas", headers={"authorization": a}).status_code for a in spellings] == \
        [200, 200, 200, 200, 429]


def test_a_refused_key_is_metered_by_its_address_and_never_gets_a_bucket(limited):
    """Refused keys count against the client address (its request bucket and its failure
    budget); none of them opens a bucket of its own."""
    client, _ = limited
    statuses = [client.get("/v1/schemas", headers={"authorization": f"Bearer ss_guess{i}"}).status_code
                for i in range(4)]
    assert statuses == [401, 401, 401, 429]  # the address's burst of 3
    assert not [k for k in client.app.state.rate_limiter._buckets if k.startswith("key:")]


def test_health_metrics_and_openapi_are_not_limited(limited):
    client, _ = limited
    for _ in range(4):
        client.get("/v1/schemas")
    assert client.get("/v1/schemas").status_code == 429
    for _ in range(5):
        assert client.get("/health").status_code in (200, 503)
        assert client.get("/metrics").status_code == 200
        assert client.get("/schema/openapi.json").status_code == 200


# --- failed authentication per client address ------------------------------------------------

@pytest.fixture
def peers(monkeypatch):
    """Requests whose `x-test-peer` header names the client address the app sees (the test
    client's transport otherwise reports "testclient" for every request)."""
    from litestar.testing.transport import TestClientTransport

    real = TestClientTransport.parse_request

    def parse(self, request):
        peer = request.headers.pop("x-test-peer", "testclient")
        scope = real(self, request)
        scope["client"] = (peer, 50000)
        return scope

    monkeypatch.setattr(TestClientTransport, "parse_request", parse)


@pytest.fixture
def guarded(settings, peers):
    """The default limits (auth_failures_per_minute=10, auth_failure_burst=20; rate limit 600
    a minute in bursts of 100) on a clock the test moves; a valid key."""
    from structspec.services.keys import create_key

    clock = Clock()
    app = create_app(settings)
    app.state.rate_limiter.clock = app.state.auth_failures.clock = clock
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, clock, create_key(app.state.session_factory, "real", "real")[1]


def test_300_wrong_keys_from_one_address_are_refused_with_429_before_the_300th(guarded, settings):
    client, clock, key = guarded
    burst = settings.auth_failure_burst
    guesser = {"x-test-peer": "203.0.113.7"}
    answers = [client.get("/v1/schemas", headers={**guesser, "authorization": f"Bearer ss_guess{i}"})
               for i in range(300)]
    statuses = [r.status_code for r in answers]
    assert statuses[:burst] == [401] * burst and set(statuses[burst:]) == {429}
    body = assert_error(answers[-1], 429)
    assert answers[-1].headers["retry-after"] == "6"  # 10 a minute: one failure back every 6 s
    assert "auth_failures_per_minute" in body["detail"] and "auth_failure_burst" in body["detail"]
    assert body["errors"][0]["source"] == "auth_failures"
    # the same address with the right key is refused too, until its budget refills
    assert client.get("/v1/schemas", headers={**guesser, "authorization": f"Bearer {key}"}).status_code == 429
    # the OpenAI surface shares the budget, and answers in its own shape
    r = client.get("/openai/v1/models", headers=guesser)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    # another address: unaffected, with the key and without
    other = {"x-test-peer": "198.51.100.9"}
    assert client.get("/v1/schemas", headers={**other, "authorization": f"Bearer {key}"}).status_code == 200
    assert client.get("/v1/schemas", headers={**other, "authorization": "Bearer ss_wrong"}).status_code == 401
    # six seconds give the guesser one more try, and the right key gets through
    clock.now += 6
    assert client.get("/v1/schemas", headers={**guesser, "authorization": f"Bearer {key}"}).status_code == 200
    assert client.get("/v1/schemas", headers={**guesser, "authorization": "Bearer ss_x"}).status_code == 401
    assert client.get("/v1/schemas", headers={**guesser, "authorization": f"Bearer {key}"}).status_code == 429


def test_malformed_headers_count_as_failures_and_a_missing_key_does_not(guarded, settings):
    client, _, _ = guarded
    peer = {"x-test-peer": "203.0.113.8"}
    for _ in range(settings.auth_failure_burst * 2):  # no key at all: 401, metered by the request rate only
        assert client.get("/v1/schemas", headers=peer).status_code == 401
    headers = [{**peer, "authorization": value} for value in ("Basic dXNlcg==", "Bearer", "ss_no_scheme")]
    statuses = [client.get("/v1/schemas", headers=headers[i % 3]).status_code
                for i in range(settings.auth_failure_burst + 1)]
    assert statuses == [401] * settings.auth_failure_burst + [429]


def test_an_ipv6_client_is_counted_by_its_64_network(guarded, settings):
    client, _, _ = guarded
    for i in range(settings.auth_failure_burst):
        assert client.get("/v1/schemas", headers={"x-test-peer": f"2001:db8:1:2::{i + 1:x}",
                                                  "authorization": "Bearer ss_x"}).status_code == 401
    assert client.get("/v1/schemas", headers={"x-test-peer": "2001:db8:1:2:ffff::1"}).status_code == 429
    assert client.get("/v1/schemas", headers={"x-test-peer": "2001:db8:1:3::1"}).status_code == 401


def test_auth_failures_per_minute_zero_is_off(settings, peers):
    with TestClient(create_app(replace(settings, auth_failures_per_minute=0, rate_limit_per_minute=0))) as client:
        assert {client.get("/v1/schemas", headers={"authorization": f"Bearer ss_{i}"}).status_code
                for i in range(60)} == {401}


def test_rate_limit_zero_is_off(settings):
    with TestClient(create_app(replace(settings, rate_limit_per_minute=0, rate_limit_burst=1))) as client:
        assert {client.get("/v1/schemas").status_code for _ in range(20)} == {200}


def test_429_is_documented_on_every_v1_operation(client):
    doc = client.get("/schema/openapi.json").json()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if path.startswith("/v1/") and method in ("get", "post", "put", "delete"):
                assert "429" in op["responses"], (method, path)


# --- schema size, depth, nodes and grammar limits ---------------------------------------------

def nested_arrays(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_schema_deeper_than_max_schema_depth_is_422_naming_path_and_setting(client, settings):
    depth = settings.max_schema_depth
    ok = client.post("/v1/schemas", json={"name": "deep-ok", "schema": nested_arrays(depth - 1)})
    assert ok.status_code == 201, ok.text
    body = assert_error(client.post("/v1/schemas", json={"name": "deep", "schema": nested_arrays(depth)}), 422)
    assert "max_schema_depth" in body["detail"]
    [item] = body["errors"]
    assert item["path"] == "/items" * depth and item["source"] == "schema"
    assert f"{depth} levels" in item["message"]


def test_schema_with_too_many_nodes_is_422_naming_the_setting(settings):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50)}}
    with TestClient(create_app(replace(settings, max_schema_nodes=40))) as small:
        body = assert_error(small.post("/v1/schemas", json={"name": "wide", "schema": schema}), 422)
    assert "max_schema_nodes" in body["detail"]


def test_grammar_over_grammar_max_size_is_422_naming_the_setting(settings):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    with TestClient(create_app(replace(settings, grammar_max_size=1000))) as small:
        body = assert_error(small.post("/v1/schemas", json={"name": "big", "schema": schema}), 422)
        assert "grammar_max_size" in body["detail"]
        assert small.post("/v1/schemas", json={"name": "small", "schema": {"type": "string"}}).status_code == 201


def test_pathological_enum_is_refused_quickly_by_the_lexer_fuel(settings):
    schema = {"enum": [f"value-{i}" for i in range(100_000)]}  # ~1.4 MB: past max_schema_bytes by default
    with TestClient(create_app(replace(settings, max_schema_bytes=4 * 2**20))) as big:
        t0 = time.monotonic()
        body = assert_error(big.post("/v1/schemas", json={"name": "enum", "schema": schema}), 422)
        assert time.monotonic() - t0 < 15
    assert "grammar_initial_lexer_fuel" in body["detail"]


def ref_chain(n: int) -> dict:
    """A chain of n `$ref`s, each an anyOf of two refs to the next: small (about 70 bytes and 4
    nodes a link), but the productive check's work grows with the square of n, and past about a
    thousand links llguidance's compile overflows its stack (grammar/productive.py,
    services/schemacheck.py)."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(n)}
    return {"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def test_schema_check_slower_than_grammar_compile_timeout_s_is_422_and_its_process_is_killed(settings):
    """A check over the limit is refused and stopped: the process that ran it is killed and
    reaped, and the next check gets a fresh one. (A 1000-link chain keeps the check busy for
    many times the 1 s limit on any machine this runs on.)"""
    from structspec.services.schemacheck import CHECKER

    before = len(CHECKER.killed)
    with TestClient(create_app(replace(settings, grammar_compile_timeout_s=1))) as c:
        body = assert_error(c.post("/v1/schemas", json={"name": "slow", "schema": ref_chain(1000)}), 422)
        assert "grammar_compile_timeout_s" in body["detail"]
        [pid] = CHECKER.killed[before:]
        assert not Path(f"/proc/{pid}").exists()  # killed and reaped: not even a zombie is left
        assert c.post("/v1/schemas", json={"name": "next", "schema": {"type": "string"}}).status_code == 201


def test_a_schema_that_crashes_the_grammar_engine_is_422_and_the_api_lives_on(settings):
    """A 2000-link `$ref` chain overflows llguidance's stack (SIGSEGV, with Linux's default
    8 MiB stack). That happens in the checker's process: the schema is refused naming the
    crash, and the API answers the next request."""
    with TestClient(create_app(settings)) as c:
        body = assert_error(c.post("/v1/schemas", json={"name": "crash", "schema": ref_chain(2000)}), 422)
        assert body["detail"] == "schema is not usable"
        assert "the grammar engine crashed on it (killed by SIGSEGV)" in body["errors"][0]["message"], body
        assert c.post("/v1/schemas", json={"name": "next", "schema": {"type": "string"}}).status_code == 201


def test_schema_larger_than_max_schema_bytes_is_413_naming_the_setting(settings):
    with TestClient(create_app(replace(settings, max_schema_bytes=100))) as small:
        body = assert_error(small.post("/v1/schemas", json={"name": "s", "schema": {"description": "x" * 200}}),
                            413)
    assert "max_schema_bytes" in body["detail"] and "100" in body["detail"]


def test_body_larger_than_max_body_bytes_is_413_naming_the_limit(settings):
    with TestClient(create_app(replace(settings, max_body_bytes=1000))) as small:
        body = assert_error(small.post("/v1/schemas", json={"name": "s", "schema": {"description": "x" * 2000}}),
                            413)
    assert "1000 bytes" in body["detail"]
