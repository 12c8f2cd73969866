"""Every error the API can return has one shape: {"status_code", "detail", "errors"}."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from integration_helpers import assert_error

ROOT = Path(__file__).resolve().parents[2]


# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}


def post_raw(client, content: bytes, content_type: str = "application/json"):
    return client.post("/v1/schemas", content=content, headers={"content-type": content_type})


def test_malformed_json_body_is_400(client):
    body = assert_error(post_raw(client, b'{"name": "x", "schema": {'), 400)
    assert body["detail"].startswith("request body is not valid JSON")


def test_empty_body_is_400(client):
    body = assert_error(post_raw(client, b""), 400)
    assert "required" in body["detail"]


def test_wrong_type_is_422_naming_the_field(client):
    body = assert_error(client.post("/v1/schemas", json={"name": 5, "schema": {}}), 422)
    assert body["errors"] == [{"path": "/name", "keyword": None, "message": "Expected `str`, got `int`",
                               "source": "body"}]
    assert "/name" in body["detail"]


def test_schema_that_is_not_an_object_is_422(client):
    for schema in ([], "string", True, None):
        body = assert_error(client.post("/v1/schemas", json={"name": "x", "schema": schema}), 422)
        assert body["errors"][0]["path"] == "/schema"


def test_missing_field_is_422_naming_it(client):
    body = assert_error(client.post("/v1/schemas", json={"name": "x"}), 422)
    assert body["errors"][0]["path"] == "/schema"
    assert "schema" in body["detail"]


def test_unknown_field_is_422_naming_it(client):
    body = assert_error(client.post("/v1/schemas", json={"name": "x", "schema": {}, "shema": {}}), 422)
    assert body["errors"][0]["path"] == "/shema"


def test_body_that_is_not_an_object_is_422(client):
    body = assert_error(post_raw(client, b"[1, 2]"), 422)
    assert body["errors"][0]["path"] == ""


def test_ten_megabyte_body_is_413_naming_the_limit(client, settings):
    body = assert_error(post_raw(client, b" " * (10 * 1024 * 1024)), 413)
    assert str(settings.max_body_bytes) in body["detail"]


def test_unknown_route_is_404_and_wrong_method_is_405(client):
    assert "/v2/nothing" in assert_error(client.get("/v2/nothing"), 404)["detail"]
    assert "PUT" in assert_error(client.put("/v1/schemas", json={}), 405)["detail"]
    assert_error(client.patch("/health"), 405)


def test_unhandled_exception_is_500_with_a_generic_message_and_is_logged(client, monkeypatch, caplog):
    from structspec.services.schemas import SchemaRegistry

    def boom(self, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(SchemaRegistry, "list", boom)
    r = client.get("/v1/schemas")
    body = assert_error(r, 500)
    assert body == {"status_code": 500, "detail": "internal server error", "errors": []}
    assert "secret" not in r.text
    assert any("secret internals" in (rec.exc_text or "") or rec.exc_info for rec in caplog.records)


def test_openapi_document_is_served(client):
    r = client.get("/schema/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert {"/v1/schemas", "/v1/schemas/{schema_id}", "/v1/schemas/by-name/{name}", "/health"} <= set(doc["paths"])
    assert "ErrorBody" in json.dumps(doc["components"])


def test_importing_and_building_the_app_does_not_import_torch(settings):
    code = ("import sys; from structspec.api.app import create_app; from structspec.config import Settings; "
            f"create_app(Settings(data_dir={str(settings.data_dir)!r})); "
            "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_body_nested_too_deeply_for_the_decoder_is_400(client):
    deep = '{"type":"array","items":' * 3000 + "{}" + "}" * 3000
    body = assert_error(post_raw(client, ('{"name":"deep","schema":' + deep + "}").encode()), 400)
    assert "nested too deeply" in body["detail"]


def test_schema_nested_too_deeply_for_the_checker_is_422(client):
    deep = {}
    for _ in range(400):
        deep = {"type": "array", "items": deep}
    assert_error(client.post("/v1/schemas", json={"name": "deep", "schema": deep}), 422)


def test_body_that_is_not_utf8_is_400(client):
    body = assert_error(post_raw(client, '{"name":"\u00e9","schema":{}}'.encode("latin-1")), 400)
    assert "UTF-8" in body["detail"]
