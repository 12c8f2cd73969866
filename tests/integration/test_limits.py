"""The service's limits over HTTP: each refusal is a 413/422/429 in the API's error shape that
names the limit and its setting (docs/api.md#limits)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from litestar.testing import TestClient

from integration_helpers import assert_error
from structspec.api.app import create_app


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


def test_each_authorization_value_has_its_own_bucket(limited):
    from structspec.services.keys import create_key

    client, _ = limited
    one, two = (create_key(client.app.state.session_factory, name, name)[1] for name in ("one", "two"))
    for _ in range(3):
        assert client.get("/v1/schemas", headers={"authorization": f"Bearer {one}"}).status_code == 200
    assert client.get("/v1/schemas", headers={"authorization": f"Bearer {one}"}).status_code == 429
    assert client.get("/v1/schemas", headers={"authorization": f"Bearer {two}"}).status_code == 200
    # no header: the client address's bucket (fresh), then auth refuses it (keys exist)
    assert client.get("/v1/schemas").status_code == 401


def test_a_wrong_key_is_metered_too(limited):
    """The limiter runs before auth: a refused key's requests count like any other (each distinct
    header value has its own bucket, though; see docs/api.md#limits)."""
    client, _ = limited
    guess = {"authorization": "Bearer ss_guess"}
    assert [client.get("/v1/schemas", headers=guess).status_code for _ in range(4)] == [401, 401, 401, 429]


def test_health_metrics_and_openapi_are_not_limited(limited):
    client, _ = limited
    for _ in range(4):
        client.get("/v1/schemas")
    assert client.get("/v1/schemas").status_code == 429
    for _ in range(5):
        assert client.get("/health").status_code in (200, 503)
        assert client.get("/metrics").status_code == 200
        assert client.get("/schema/openapi.json").status_code == 200


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


def test_schema_check_slower_than_grammar_compile_timeout_s_is_422(settings, monkeypatch):
    """The request answers once the timeout passes, while the check still runs: the check is
    held until the answer is in, so an answer that waited for it cannot come first."""
    import structspec.grammar as grammar

    real = grammar.check_schema
    release, ended = threading.Event(), threading.Event()

    def held(schema, limits=None):
        release.wait(30)  # a bound only for a request that, wrongly, waits for the check
        try:
            return real(schema, limits)
        finally:
            ended.set()

    monkeypatch.setattr(grammar, "check_schema", held)
    try:
        with TestClient(create_app(replace(settings, grammar_compile_timeout_s=1))) as c:
            body = assert_error(c.post("/v1/schemas", json={"name": "slow", "schema": {"type": "string"}}), 422)
            assert not ended.is_set(), "the request waited for the schema check to end"
    finally:
        release.set()
    assert "grammar_compile_timeout_s" in body["detail"]


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
