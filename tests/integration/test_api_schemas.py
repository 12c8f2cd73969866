"""/v1/schemas against SQLite and PostgreSQL: registration, versions, reads, pagination,
soft delete, and schema validation errors."""

from __future__ import annotations

import threading
import uuid
from datetime import datetime

import pytest
from integration_helpers import assert_error

INVOICE = {"type": "object", "properties": {"total": {"type": "number"}, "currency": {"type": "string"}},
           "required": ["total"]}


# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}


def register(client, name="invoice", schema=INVOICE, **extra):
    return client.post("/v1/schemas", json={"name": name, "schema": schema, **extra})


def test_register_returns_201_with_the_new_record(client):
    r = register(client, description="an invoice")
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["name"] == "invoice" and body["version"] == 1 and body["description"] == "an invoice"
    assert uuid.UUID(body["id"])
    assert len(body["hash"]) == 64
    assert datetime.fromisoformat(body["created_at"]).tzinfo is not None
    assert body["warnings"] == []


def test_what_the_grammar_cannot_enforce_registers_with_warnings_naming_it(client):
    schema = {"type": "object", "properties": {"site": {"type": "string", "format": "url"},
                                               "v": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}}}
    r = register(client, name="warned", schema=schema)
    assert r.status_code == 201, r.text
    warnings = r.json()["warnings"]
    assert len(warnings) == 2
    assert warnings[0].startswith("/properties/site/format [format]: format 'url' is unknown")
    assert warnings[1].startswith("/properties/v/oneOf [oneOf]: oneOf is generated as anyOf")
    again = register(client, name="warned", schema=schema)  # the same content again says the same
    assert again.status_code == 200 and again.json()["warnings"] == warnings


def test_same_content_again_returns_200_with_the_existing_record(client):
    first = register(client).json()
    # Same schema, other key order: the content hash ignores order and whitespace.
    reordered = {"required": ["total"], "properties": dict(reversed(INVOICE["properties"].items())),
                 "type": "object"}
    again = register(client, schema=reordered)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == first["id"] and again.json()["version"] == 1


def test_new_content_under_the_same_name_is_the_next_version(client):
    v1 = register(client).json()
    v2 = register(client, schema={**INVOICE, "required": ["total", "currency"]})
    assert v2.status_code == 201, v2.text
    assert v2.json()["version"] == 2 and v2.json()["id"] != v1["id"] and v2.json()["hash"] != v1["hash"]
    # Re-registering v1's content returns v1 (any live version with equal content).
    assert register(client).json()["id"] == v1["id"]
    # Another name starts at version 1.
    assert register(client, name="receipt").json()["version"] == 1


def test_get_by_id_returns_the_full_record_with_the_schema_body_in_key_order(client):
    created = register(client).json()
    r = client.get(f"/v1/schemas/{created['id']}")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["schema"] == INVOICE
    assert list(body["schema"]["properties"]) == ["total", "currency"]  # property order is generation order
    assert {k: body[k] for k in ("id", "name", "version", "hash")} == \
        {k: created[k] for k in ("id", "name", "version", "hash")}


def test_by_name_returns_the_latest_live_version_or_the_one_asked_for(client):
    register(client)
    v2 = register(client, schema={**INVOICE, "title": "v2"}).json()
    latest = client.get("/v1/schemas/by-name/invoice")
    assert latest.status_code == 200 and latest.json()["version"] == 2 and latest.json()["schema"]["title"] == "v2"
    assert client.get("/v1/schemas/by-name/invoice?version=1").json()["version"] == 1
    assert_error(client.get("/v1/schemas/by-name/invoice?version=3"), 404)
    assert_error(client.get("/v1/schemas/by-name/nothing-here"), 404)
    # Deleting the latest makes the previous one the latest.
    assert client.delete(f"/v1/schemas/{v2['id']}").status_code == 204
    assert client.get("/v1/schemas/by-name/invoice").json()["version"] == 1


def test_unknown_and_malformed_ids_are_404(client):
    body = assert_error(client.get(f"/v1/schemas/{uuid.uuid4()}"), 404)
    assert "no schema with id" in body["detail"]
    assert "no schema with id" in assert_error(client.get("/v1/schemas/not-a-uuid"), 404)["detail"]
    assert_error(client.delete(f"/v1/schemas/{uuid.uuid4()}"), 404)


def test_delete_is_soft_then_get_and_list_say_gone(client):
    created = register(client).json()
    r = client.delete(f"/v1/schemas/{created['id']}")
    assert r.status_code == 204 and r.content == b""
    assert_error(client.get(f"/v1/schemas/{created['id']}"), 404)
    assert_error(client.delete(f"/v1/schemas/{created['id']}"), 404)
    assert client.get("/v1/schemas").json()["total"] == 0
    # The version number is not reused, and equal content makes a new live version.
    again = register(client)
    assert again.status_code == 201 and again.json()["version"] == 2


def test_list_is_paginated_and_excludes_deleted(client):
    ids = [register(client, name=f"s{i:02d}", schema={"type": "object", "title": str(i)}).json()["id"]
           for i in range(7)]
    client.delete(f"/v1/schemas/{ids[3]}")
    page1 = client.get("/v1/schemas?limit=4&offset=0").json()
    page2 = client.get("/v1/schemas?limit=4&offset=4").json()
    assert (page1["total"], page1["limit"], page1["offset"]) == (6, 4, 0)
    assert (page2["total"], page2["limit"], page2["offset"]) == (6, 4, 4)
    names = [i["name"] for i in page1["items"] + page2["items"]]
    assert names == ["s00", "s01", "s02", "s04", "s05", "s06"]
    assert "schema" not in page1["items"][0]  # summaries; the body is in GET /v1/schemas/{id}
    assert client.get("/v1/schemas?offset=100").json()["items"] == []
    assert [i["name"] for i in client.get("/v1/schemas?name=s05").json()["items"]] == ["s05"]


def test_list_rejects_bad_paging_parameters_naming_them(client):
    for query, param in [("limit=0", "limit"), ("limit=501", "limit"), ("limit=abc", "limit"), ("offset=-1", "offset")]:
        body = assert_error(client.get(f"/v1/schemas?{query}"), 422)
        assert body["errors"][0]["path"] == param and body["errors"][0]["source"] == "query"
        assert param in body["detail"]


def test_invalid_json_schema_is_422_naming_the_path(client):
    body = assert_error(register(client, schema={"type": "strin"}), 422)
    assert body["detail"] == "schema is not usable"
    assert body["errors"][0]["path"] == "/type"
    assert body["errors"][0]["source"] == "schema"
    assert client.get("/v1/schemas").json()["total"] == 0


def test_unsupported_keyword_is_422_naming_keyword_and_path(client):
    body = assert_error(register(client, schema={"type": "array", "uniqueItems": True}), 422)
    assert body["detail"] == "schema is not usable"
    assert body["errors"][0]["keyword"] == "uniqueItems"
    assert body["errors"][0]["path"] == "/uniqueItems"


@pytest.mark.parametrize("name", ["", "has space", "slash/name", "x" * 201, "é", ".", "..", "...", "trailing\n"])
def test_invalid_names_are_422_naming_the_field(client, name):
    body = assert_error(register(client, name=name), 422)
    assert body["errors"][0]["path"] == "/name"


def test_valid_names_use_the_whole_alphabet(client):
    name = "A-z_0.9" + "x" * 193
    assert register(client, name=name).status_code == 201
    assert client.get(f"/v1/schemas/by-name/{name}").status_code == 200


def test_schema_larger_than_max_schema_bytes_is_413_naming_the_limit(client, settings):
    big = {"type": "object", "description": "x" * settings.max_schema_bytes}
    body = assert_error(register(client, schema=big), 413)
    assert str(settings.max_schema_bytes) in body["detail"]


def test_concurrent_registrations_under_one_name_get_distinct_versions(settings):
    from structspec.services.schemas import SchemaRegistry
    from structspec.db.session import make_engine, make_session_factory

    engine = make_engine(settings.database_url)
    registry = SchemaRegistry(make_session_factory(engine), settings)
    results, errors = [], []

    def worker(i: int) -> None:
        try:
            results.append(registry.register("race", {"type": "object", "title": str(i % 6)}))
        except Exception as e:  # collected, so a failure names its cause
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    engine.dispose()
    assert errors == []
    versions = {rec.version: rec.hash for rec, _ in results}
    assert sorted(versions) == list(range(1, 7))  # six distinct contents, two repeats
    assert sum(created for _, created in results) == 6
