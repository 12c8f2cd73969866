"""API keys and tenant isolation: every /v1 resource of one key's tenant is invisible to
another key (404, never the data), on SQLite and PostgreSQL."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import uuid
from dataclasses import replace

import pytest
import sqlalchemy as sa
from litestar.testing import TestClient

from conftest import ROOT
from integration_helpers import assert_error
from structspec.api.app import create_app
from structspec.services.keys import create_key, revoke_key
from structspec.db.session import make_engine, make_session_factory

SCHEMA = {"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}


# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}


@pytest.fixture
def keys(client):
    factory = client.app.state.session_factory
    _, alice = create_key(factory, "alice laptop", "alice")
    _, bob = create_key(factory, "bob", "bob")
    return {"alice": {"authorization": f"Bearer {alice}"}, "bob": {"authorization": f"Bearer {bob}"}}


def test_only_the_hash_of_a_key_is_stored(client, settings):
    record, key = create_key(client.app.state.session_factory, "ci", "acme")
    assert key.startswith("ss_") and len(key) > 40
    engine = make_engine(settings.database_url)
    try:
        with engine.connect() as conn:
            row = conn.execute(sa.text("SELECT * FROM api_keys")).mappings().one()
    finally:
        engine.dispose()
    assert row["key_hash"] == hashlib.sha256(key.encode()).hexdigest()
    assert all(key not in str(v) for v in row.values())
    assert key.startswith(row["prefix"]) and len(row["prefix"]) < 12


def test_without_keys_the_api_is_open(client):
    assert client.get("/v1/schemas").status_code == 200


def test_require_auth_closes_the_api_before_any_key_exists(settings):
    from litestar.testing import TestClient

    from structspec.api.app import create_app

    with TestClient(create_app(replace(settings, require_auth=True)), raise_server_exceptions=False) as c:
        body = assert_error(c.get("/v1/schemas"), 401)
        assert "Authorization: Bearer" in body["detail"]


@pytest.mark.parametrize("header, why", [
    (None, "missing"), ("Bearer", "malformed"), ("Basic dXNlcjpwYXNz", "malformed"),
    ("Bearer ss_not-a-real-key", "invalid")])
def test_a_request_without_a_valid_key_gets_401(client, keys, header, why):
    headers = {"authorization": header} if header else {}
    for method, path in (("GET", "/v1/schemas"), ("POST", "/v1/schemas"), ("GET", f"/v1/extractions/{uuid.uuid4()}"),
                         ("POST", "/v1/batches")):
        r = client.request(method, path, headers=headers, json={})
        body = assert_error(r, 401)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert body["errors"][0]["message"] == why


def test_every_documented_v1_operation_needs_a_key(client, keys):
    doc = client.get("/schema/openapi.json").json()
    operations = [(method.upper(), path) for path, item in doc["paths"].items() if path.startswith("/v1/")
                  for method in item if method in ("get", "post", "put", "delete", "patch")]
    assert len(operations) >= 14
    for method, path in operations:
        concrete = path.replace("{schema_id}", str(uuid.uuid4())).replace("{job_id}", str(uuid.uuid4())) \
            .replace("{batch_id}", str(uuid.uuid4())).replace("{name}", "x").replace("{file_id}", "file-x")
        assert "{" not in concrete, path
        assert_error(client.request(method, concrete, json={}), 401)
        assert doc["paths"][path][method.lower()]["security"] == [{"ApiKey": []}], path
        assert "401" in doc["paths"][path][method.lower()]["responses"], path


def test_a_revoked_key_stops_working_at_once(client, keys):
    record, key = create_key(client.app.state.session_factory, "temp", "alice")
    headers = {"authorization": f"Bearer {key}"}
    assert client.get("/v1/schemas", headers=headers).status_code == 200
    revoke_key(client.app.state.session_factory, str(record.id))
    assert_error(client.get("/v1/schemas", headers=headers), 401)
    assert client.get("/v1/schemas", headers=keys["alice"]).status_code == 200  # other keys unaffected


def test_health_metrics_and_the_api_document_stay_open(client, keys):
    assert client.get("/health").status_code in (200, 503)  # open; 503 only says a dependency is down
    assert client.get("/metrics").status_code == 200  # what it reveals: the next test
    doc = client.get("/schema/openapi.json")
    assert doc.status_code == 200
    assert doc.json()["paths"]["/v1/schemas"]["post"]["security"] == [{"ApiKey": []}]
    assert "401" in doc.json()["paths"]["/v1/extractions"]["post"]["responses"]


def test_open_metrics_name_no_tenants_schema_and_the_operators_token_shows_them(client, keys, settings):
    from prometheus_client.parser import text_string_to_metric_families

    from structspec.db.stats import StatsRepository

    stats = {"strategy": "schema", "draft_len": 2, "output_tokens": 7, "target_passes": 5, "proposed": 10,
             "accepted": 2, "decode_s": 0.1, "accepted_by_position": [2, 0], "proposed_by_position": [5, 5]}
    secrets = {}
    for tenant, name in (("alice", "alice-payroll-2026"), ("bob", "bob-merger-target")):
        r = client.post("/v1/schemas", headers=keys[tenant], json={"name": name, "schema": SCHEMA})
        assert r.status_code == 201, r.text
        secrets[tenant] = (name, r.json()["id"])
        with client.app.state.session_factory.begin() as session:
            StatsRepository(session).record(uuid.UUID(r.json()["id"]), stats, half_life=500, latency_s=0.5)

    body = client.get("/metrics").text  # no key of any kind
    for name, schema_id in secrets.values():
        assert name not in body and schema_id not in body and schema_id.replace("-", "") not in body
    assert "alice" not in body and "bob" not in body
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(body) for s in family.samples}
    # the totals are all there, summed over both tenants' schemas
    assert samples[("structspec_requests_total", (("strategy", "schema"),))] == 2
    assert samples[("structspec_output_tokens_total", (("strategy", "schema"),))] == 14

    with TestClient(create_app(replace(settings, metrics_token="ops-token")), raise_server_exceptions=False) as ops:
        assert_error(ops.get("/metrics"), 401)
        assert_error(ops.get("/metrics", headers=keys["alice"]), 401)  # a tenant's API key is not the token
        body = ops.get("/metrics", headers={"authorization": "Bearer ops-token"}).text
        for tenant, (name, schema_id) in secrets.items():
            assert f'tenant="{tenant}"' in body and f'schema="{name}"' in body and schema_id in body


def test_a_second_tenant_cannot_read_list_cancel_or_delete_the_first_tenants_objects(client, keys):
    alice, bob = keys["alice"], keys["bob"]
    r = client.post("/v1/schemas", headers=alice, json={"name": "receipt", "schema": SCHEMA})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    r = client.post("/v1/extractions", headers=alice, json={"schema_id": sid, "document": "Total: 12.50"})
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    r = client.post("/v1/batches", headers=alice, json={"schema_id": sid, "documents": [{"document": "Total: 3"}]})
    assert r.status_code == 202, r.text
    batch = r.json()["id"]

    # Every read, list, write and cancel by the other tenant: 404 (or an empty list), never the data.
    attempts = [
        ("GET", f"/v1/schemas/{sid}", None), ("GET", "/v1/schemas/by-name/receipt", None),
        ("DELETE", f"/v1/schemas/{sid}", None), ("GET", f"/v1/schemas/{sid}/stats", None),
        ("PUT", f"/v1/schemas/{sid}/strategy", {"strategy": "none"}),
        ("POST", "/v1/extractions", {"schema_id": sid, "document": "x"}),
        ("GET", f"/v1/extractions/{job}", None), ("POST", f"/v1/extractions/{job}/cancel", None),
        ("DELETE", f"/v1/extractions/{job}", None), ("DELETE", f"/v1/batches/{batch}", None),
        ("POST", "/v1/batches", {"schema_id": sid, "documents": [{"document": "x"}]}),
        ("GET", f"/v1/batches/{batch}", None), ("GET", f"/v1/batches/{batch}/results", None),
        ("POST", f"/v1/batches/{batch}/cancel", None),
    ]
    for method, path, body in attempts:
        r = client.request(method, path, headers=bob, json=body)
        assert_error(r, 404)
        assert "properties" not in r.text and "12.50" not in r.text, (method, path, r.text)
    for listing in ("/v1/schemas", "/v1/extractions", f"/v1/extractions?batch_id={batch}", "/v1/batches"):
        page = client.get(listing, headers=bob).json()
        assert page["total"] == 0 and page["items"] == [], listing
    assert client.get("/v1/schemas?name=receipt", headers=bob).json()["total"] == 0
    r = client.post(f"/v1/batches?schema_id={sid}", headers={**bob, "content-type": "application/x-ndjson"},
                    content=b'{"document": "x"}\n')
    assert_error(r, 404)

    # Nothing of alice's changed, and she still sees all of it.
    assert client.get(f"/v1/schemas/{sid}", headers=alice).status_code == 200
    assert client.get(f"/v1/schemas/{sid}/stats", headers=alice).json()["pinned"] is None
    assert client.get(f"/v1/extractions/{job}", headers=alice).json()["status"] == "queued"
    assert client.get(f"/v1/batches/{batch}", headers=alice).json()["status"] == "queued"
    assert client.get("/v1/schemas", headers=alice).json()["total"] == 1
    assert (client.get("/v1/extractions", headers=alice).json()["total"],
            client.get("/v1/batches", headers=alice).json()["total"]) == (2, 1)


def test_tenants_have_their_own_names_and_versions(client, keys):
    a = client.post("/v1/schemas", headers=keys["alice"], json={"name": "invoice", "schema": SCHEMA}).json()
    other = {**SCHEMA, "title": "bob's"}
    b = client.post("/v1/schemas", headers=keys["bob"], json={"name": "invoice", "schema": other}).json()
    assert (a["version"], b["version"]) == (1, 1) and a["id"] != b["id"]
    # the same content under the same name is a separate record per tenant, not a shared one
    b2 = client.post("/v1/schemas", headers=keys["bob"], json={"name": "invoice", "schema": SCHEMA})
    assert b2.status_code == 201 and b2.json()["version"] == 2
    assert client.get("/v1/schemas/by-name/invoice", headers=keys["alice"]).json()["id"] == a["id"]


def test_inline_schemas_are_registered_in_the_callers_tenant(client, keys):
    r = client.post("/v1/extractions", headers=keys["alice"], json={"schema": SCHEMA, "document": "Total: 1"})
    assert r.status_code == 202, r.text
    sid = client.get(f"/v1/extractions/{r.json()['id']}", headers=keys["alice"]).json()["schema_id"]
    assert client.get(f"/v1/schemas/{sid}", headers=keys["alice"]).status_code == 200
    assert_error(client.get(f"/v1/schemas/{sid}", headers=keys["bob"]), 404)


def test_keys_create_prints_the_key_as_its_last_word(tmp_path):
    env = {**os.environ, "STRUCTSPEC_DATA_DIR": str(tmp_path), "STRUCTSPEC_DATABASE_URL": "",
           "STRUCTSPEC_BROKER_URL": ""}
    run = lambda *a: subprocess.run([sys.executable, "-m", "structspec.cli", "keys", *a], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=120)
    created = run("create", "--name", "ci-bot", "--tenant", "acme")
    assert created.returncode == 0, created.stderr
    key = created.stdout.split()[-1]
    from structspec.services.keys import hash_key

    engine = make_engine(f"sqlite:///{tmp_path / 'structspec.db'}")
    try:
        with make_session_factory(engine)() as session:
            row = session.execute(sa.text("SELECT tenant, key_hash FROM api_keys")).one()
    finally:
        engine.dispose()
    assert tuple(row) == ("acme", hash_key(key))
    listed = run("list")
    assert listed.returncode == 0 and "tenant=acme" in listed.stdout and key not in listed.stdout
    bad = run("revoke", "not-an-id")
    assert bad.returncode == 2 and "no API key" in bad.stderr


def test_the_cli_client_sends_its_api_key(client, keys, tmp_path):
    from structspec.client import Client, ClientError

    factory = client.app.state.session_factory
    _, key = create_key(factory, "cli", "alice")
    with Client("http://testserver", http=client, api_key=key) as c:
        registered = c.register(str(tmp_path / "receipt.json"), SCHEMA)
    assert client.get(f"/v1/schemas/{registered['id']}", headers=keys["alice"]).status_code == 200
    with Client("http://testserver", http=client) as c, pytest.raises(ClientError, match="401"):
        c.register(str(tmp_path / "receipt.json"), SCHEMA)
