"""Hostile input at the edge, on SQLite and PostgreSQL alike (issue 30, items 3, 5 and 6): each
row is a request, the status it must get and a phrase its message must hold. Before these
checks a NUL reached PostgreSQL as a 500, a 300-character document id overflowed its column,
unproducible schemas registered, and refused requests still registered their inline schema."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from litestar.testing import TestClient

from structspec.api.app import create_app

OBJECT = {"type": "object", "properties": {"name": {"type": "string"}}}
NDJSON = {"content-type": "application/x-ndjson"}
JSON = {"content-type": "application/json"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Ada"}], "response_format": {"type": "json_object"}}
CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}

# (id, method, url, request keyword arguments, status, phrase in the answer); {sid}: a registered schema
CASES: list[tuple[str, str, str, dict[str, Any], int, str]] = [
    # item 3: NUL anywhere, over-long ids
    ("nul-name-query", "GET", "/v1/schemas?name=a%00b", {}, 400, "query parameter 'name' holds %00"),
    ("nul-after-openai", "GET", "/openai/v1/files?after=f%00", {}, 400, "query parameter 'after' holds %00"),
    ("nul-purpose", "GET", "/openai/v1/files?purpose=batch%00", {}, 400, "query parameter 'purpose' holds %00"),
    ("nul-file-id", "GET", "/openai/v1/files/file-%00", {}, 400, "the URL path holds %00"),
    ("nul-batch-id", "GET", "/v1/batches/%00", {}, 400, "the URL path holds %00"),
    ("nul-schema-name-body", "POST", "/v1/schemas", {"content": b'{"name": "a\\u0000", "schema": {}}', "headers": JSON},
     400, "holds \\u0000 (U+0000) at /name"),
    ("nul-inline-schema", "POST", "/v1/extractions",
     {"content": b'{"schema": {"enum": ["\\u0000"]}, "document": "d"}', "headers": JSON}, 400, "at /schema/enum/0"),
    ("nul-webhook-query", "POST", "/v1/batches?schema_id={sid}&webhook_url=http://x/%00",
     {"content": b'{"document": "d"}\n', "headers": NDJSON}, 400, "query parameter 'webhook_url' holds %00"),
    ("nul-ndjson-line", "POST", "/v1/batches?schema_id={sid}",
     {"content": b'{"document": "d"}\n{"id": "b\\u0000", "document": "d"}\n', "headers": NDJSON}, 400, "line 2, /id"),
    ("nul-chat-message", "POST", "/openai/v1/chat/completions",
     {"content": b'{"model": "m", "messages": [{"role": "user", "content": "a\\u0000"}]}', "headers": JSON},
     400, "/messages/0/content"),
    ("escaped-backslash-is-not-nul", "POST", "/v1/schemas",
     {"content": b'{"name": "fine", "schema": {"description": "a\\\\u0000"}}', "headers": JSON}, 201, '"fine"'),
    ("long-doc-id", "POST", "/v1/batches", {"json": {"schema_id": "{sid}", "documents": [
        {"id": "x" * 199, "document": "d"}]}}, 422, "field 'id' is 201 characters as JSON; the limit is 200"),
    ("long-doc-id-ndjson", "POST", "/v1/batches?schema_id={sid}",
     {"content": b'{"id": "' + b"y" * 5000 + b'", "document": "d"}\n', "headers": NDJSON}, 422, "the limit is 200"),
    # item 5: schemas that can produce nothing
    ("ref-self", "POST", "/v1/schemas", {"json": {"name": "s", "schema": {"$ref": "#"}}}, 422,
     "$ref '#' allows no finite value"),
    ("ref-cycle", "POST", "/v1/schemas", {"json": {"name": "s", "schema": CYCLE}}, 422, "/$defs/a/$ref"),
    ("ref-required", "POST", "/v1/schemas", {"json": {"name": "s", "schema": {
        "type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}}}, 422, "/properties/x/$ref"),
    ("min-items", "POST", "/v1/schemas", {"json": {"name": "s", "schema": {"type": "array", "minItems": 10**18}}},
     422, "no output of at most 65536 tokens"),
    ("min-length", "POST", "/v1/schemas", {"json": {"name": "s", "schema": {"type": "string", "minLength": 10**9}}},
     422, "minLength is 1000000000"),
    ("min-properties", "POST", "/v1/schemas", {"json": {"name": "s", "schema": {
        "type": "object", "minProperties": 10**9}}}, 422, "minProperties is 1000000000"),
    ("recursive-tree-is-fine", "POST", "/v1/schemas", {"json": {"name": "tree", "schema": {
        "type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}}}, 201, '"tree"'),
    # item 6
    ("seed-too-big", "POST", "/v1/extractions", {"json": {"schema_id": "{sid}", "document": "d",
                                                          "options": {"seed": 2**80}}}, 422, "seed must be between 0"),
    ("seed-negative-query", "POST", "/v1/batches?schema_id={sid}&seed=-1",
     {"content": b'{"document": "d"}\n', "headers": NDJSON}, 422, "seed must be between 0"),
    ("stream-string", "POST", "/openai/v1/chat/completions", {"json": {**CHAT, "stream": "yes"}}, 400,
     "stream must be true or false"),
    ("stream-false-string", "POST", "/openai/v1/chat/completions", {"json": {**CHAT, "stream": "false"}}, 400,
     "stream must be true or false"),
    ("webhook-crlf", "POST", "/v1/batches", {"json": {"schema_id": "{sid}", "documents": [{"document": "d"}],
                                                      "webhook_url": "http://hooks.example/x\r\nX: y"}},
     422, "must not hold spaces, tabs, line breaks"),
    ("webhook-leading-space", "POST", "/v1/batches", {"json": {"schema_id": "{sid}", "documents": [
        {"document": "d"}], "webhook_url": " http://hooks.example/x"}}, 422, "must not hold spaces"),
    ("webhook-loopback-under-star", "POST", "/v1/batches", {"json": {"schema_id": "{sid}", "documents": [
        {"document": "d"}], "webhook_url": "http://127.0.0.1:8080/x"}}, 422, "is loopback"),
    ("webhook-metadata-under-star", "POST", "/v1/batches", {"json": {"schema_id": "{sid}", "documents": [
        {"document": "d"}], "webhook_url": "http://169.254.169.254/latest"}}, 422, "is link-local"),
    ("webhook-private-under-star", "POST", "/v1/batches", {"json": {"schema_id": "{sid}", "documents": [
        {"document": "d"}], "webhook_url": "http://[::ffff:10.0.0.1]/x"}}, 422, "is private"),
    ("webhook-localhost-under-star", "POST", "/v1/batches", {"json": {"schema_id": "{sid}", "documents": [
        {"document": "d"}], "webhook_url": "http://localhost/x"}}, 422, "is this machine"),
    ("webhook-listed-private-address", "POST", "/v1/batches", {"json": {"schema_id": "{sid}", "documents": [
        {"document": "d"}], "webhook_url": "http://10.1.2.3/x"}}, 202, '"total":1'),
    ("ndjson-unknown-parameter", "POST", "/v1/batches?schema_id={sid}&temprature=0.5",
     {"content": b'{"document": "d"}\n', "headers": NDJSON}, 422, "unknown query parameter 'temprature'"),
    ("ndjson-duplicate-id", "POST", "/v1/batches?schema_id={sid}",
     {"content": b'{"id": "a", "document": "d"}\n{"id": "b", "document": "d"}\n{"id": "a", "document": "e"}\n',
      "headers": NDJSON}, 422, "document id 'a' is given twice: line 1 and line 3"),
    ("json-duplicate-id", "POST", "/v1/batches", {"json": {"schema_id": "{sid}", "documents": [
        {"id": 7, "document": "d"}, {"id": 7, "document": "e"}]}}, 422, "/documents/0 and /documents/1"),
    ("text-plain-schema", "POST", "/v1/schemas", {"content": b'{"name": "x", "schema": {}}',
                                                  "headers": {"content-type": "text/plain"}}, 415,
     "content type 'text/plain' is not accepted here"),
    ("form-extraction", "POST", "/v1/extractions", {"content": b"document=d",
                                                    "headers": {"content-type": "application/x-www-form-urlencoded"}},
     415, "send application/json"),
    ("lone-surrogate", "POST", "/v1/schemas", {"content": b'{"name": "x\\ud800", "schema": {}}', "headers": JSON},
     400, "a lone UTF-16 surrogate \\ud800 at byte"),
    ("lone-low-surrogate", "POST", "/v1/schemas", {"content": b'{"name": "x\\udc00y", "schema": {}}', "headers": JSON},
     400, "lone UTF-16 surrogate \\udc00"),
    ("surrogate-pair-is-fine", "POST", "/v1/extractions", {"json": {"schema_id": "{sid}", "document": "\U0001f600"}},
     202, '"queued"'),
    ("invalid-regex", "POST", "/v1/schemas", {"json": {"name": "r", "schema": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "(a"}}}}}, 422, '"path":"/properties/code/pattern"'),
]


@pytest.fixture
def edge_client(settings):
    # webhooks allowed to any public host, and to one private address listed by itself
    app = create_app(dataclasses.replace(settings, webhook_hosts="*, 10.1.2.3", document_token_check="off"))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _fill(value: Any, sid: str) -> Any:
    if isinstance(value, str):
        return value.replace("{sid}", sid)
    if isinstance(value, dict):
        return {k: _fill(v, sid) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, sid) for v in value]
    return value


@pytest.mark.parametrize("case, method, url, kwargs, status, phrase", CASES, ids=[c[0] for c in CASES])
def test_edge_input_gets_its_status_and_a_message_naming_the_problem(edge_client, case, method, url, kwargs,
                                                                      status, phrase, monkeypatch):
    import structspec.worker.app

    monkeypatch.setattr(structspec.worker.app, "enqueue", lambda app, ids, chunk_size=None: None)  # no broker needed
    sid = edge_client.post("/v1/schemas", json={"name": "base", "schema": OBJECT}).json()["id"]
    r = edge_client.request(method, _fill(url, sid), **_fill(kwargs, sid))
    assert r.status_code == status, r.text
    assert phrase in r.text or phrase in " ".join(_strings(r.json())), r.text


def _strings(value: Any) -> list[str]:
    """Every string in a decoded JSON answer (so a phrase holding a backslash reads as sent)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


@pytest.mark.parametrize("request_body, status", [
    ({"schema": OBJECT, "document": "d", "options": {"draft_len": 99}}, 422),  # a bad option
    ({"schema": OBJECT, "document": "d" * (1024 * 1024 + 1)}, 413),  # a document over max_document_bytes
])
def test_a_refused_extraction_registers_no_inline_schema(edge_client, request_body, status):
    r = edge_client.post("/v1/extractions", json=request_body)
    assert r.status_code == status, r.text
    assert edge_client.get("/v1/schemas").json()["items"] == []


def test_a_refused_chat_registers_no_inline_schema(edge_client):
    body = {"model": "m", "messages": [{"role": "user", "content": "d" * (1024 * 1024 + 1)}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": OBJECT}}}
    r = edge_client.post("/openai/v1/chat/completions", json=body)
    assert r.status_code == 413, r.text
    assert edge_client.get("/v1/schemas").json()["items"] == []
