"""Schemathesis against the OpenAPI document the app itself serves (GET /schema/openapi.json),
in-process over ASGI, on each database backend.

Every operation gets a bounded, derandomized run (the same cases on every run, so CI is
reproducible) of schemathesis' default checks, among them: no 5xx, every status code
documented for its operation, the content type documented, and the body valid against the
documented response schema.

Submissions are published to the embedded broker (kombu's SQLAlchemy transport on a SQLite
file in tmp_path, as in the other API tests); no worker runs, so every job stays queued.

`fuzz_headers` is sent with every call: an API key, so the run goes through auth.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest
import schemathesis  # a test dependency (pyproject's `test` extra): missing is an error, not a skip
from hypothesis import HealthCheck, settings as hypothesis_settings
from schemathesis.checks import ignored_auth, negative_data_rejection, positive_data_acceptance

from structspec.api.guard import NUL_REASON
from structspec.api.structs import BatchCreate, ExtractionCreate, SchemaCreate, StrategyPin

MAX_EXAMPLES = 25
NDJSON = "application/x-ndjson"
BODY_TYPES = {("POST", "/v1/schemas"): SchemaCreate, ("PUT", "/v1/schemas/{schema_id}/strategy"): StrategyPin,
              ("POST", "/v1/extractions"): ExtractionCreate, ("POST", "/v1/batches"): BatchCreate}
# No worker runs, so a submission with ?wait=S always waits the full S seconds (up to 60).
# Generated waits are cut to this (still a valid value) to keep the run short.
MAX_WAIT_S = 0.2
# `make test` checks conformance on SQLite and the hostile strings on PostgreSQL (where NUL and
# long strings once gave a 500); `make test-long` each on both
LONG_PARAMS = {"test_api_conforms_to_its_openapi_document": {"database_url": "postgresql"},
               "test_nul_bytes_and_over_long_strings_in_any_parameter_never_answer_5xx": {"database_url": "sqlite"}}


@pytest.fixture
def fuzz_headers(fuzz_app) -> dict[str, str]:
    """Headers sent with every generated request: a key, so every call goes through auth (and
    acts in that key's tenant)."""
    from structspec.services.keys import create_key

    _, key = create_key(fuzz_app.state.session_factory, "schemathesis", "fuzz")
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def fuzz_app(settings) -> Iterator[object]:
    from schemathesis.python import asgi

    from structspec.api.app import create_app

    # The rate limit and the failed-auth budget off: hundreds of generated requests a second from
    # one client would be answered 429 (documented on every /v1 operation), hiding what the
    # handlers do.
    app = create_app(replace(settings, rate_limit_per_minute=0, auth_failures_per_minute=0))
    try:
        yield app
    finally:
        # schemathesis runs the app's lifespan once per app and keeps it until exit: end it here
        # so the engine and broker pool are closed before `settings` cleans up.
        asgi.shutdown_lifespans()


def accepts_schema_valid_requests(ctx, response, case):
    """schemathesis' positive_data_acceptance, except where the document cannot say what is valid:
    - a 422 whose every error is in a submitted JSON Schema (source "schema"): the `schema` field
      is any object in the document; the service checks it against the JSON Schema meta-schema
      and the grammar engine, which no OpenAPI schema expresses;
    - an NDJSON batch body: OpenAPI describes it as a string, not as one JSON object per line;
    - a 422 for an Idempotency-Key that an earlier generated request used with another body:
      whether a key is taken depends on the requests before, not on this one's shape;
    - a 422 for a batch's webhook_url alone: which hosts it may name is the server's setting
      (STRUCTSPEC_WEBHOOK_HOSTS, empty here: webhooks off), not the document's;
    - a 400 for U+0000 (api/guard.py): no string the service stores may hold it, a rule the
      document states for documents but cannot for every string inside a free-form JSON Schema;
    - a 422 for a batch document id given twice: OpenAPI cannot say that one field of the array's
      items must be unique (uniqueItems compares whole items);
    - a 400, 413, 415 or 422 about a submitted file alone (path /content, /file_id, or an upload's
      `file`): what its bytes hold (valid base64, a readable PDF, a media type structspec reads, not
      empty) or which uploaded files exist is no shape OpenAPI describes."""
    if response.status_code in (400, 413, 415, 422) and (body := _json(response)) is not None:
        errors = body.get("errors") or []
        if errors and all(e.get("path") in ("/content", "/file_id", "file") for e in errors):
            return None
    if response.status_code == 400 and (body := _json(response)) is not None:
        errors = body.get("errors") or []
        if errors and all(e.get("message") == NUL_REASON for e in errors):
            return None
    if response.status_code == 422 and (body := _json(response)) is not None:
        errors = body.get("errors") or []
        if errors and all(e.get("source") == "schema" for e in errors):
            return None
        if errors == [{"path": "Idempotency-Key", "keyword": None, "message": "reused with a different request",
                       "source": "header"}]:
            return None
        if errors and all(e.get("path") in ("/webhook_url", "webhook_url") for e in errors):
            return None
        if errors and all("is given twice" in (e.get("message") or "") for e in errors):
            return None
    if case.media_type == NDJSON:
        return None
    return positive_data_acceptance(ctx, response, case)


def rejects_schema_violating_requests(ctx, response, case):
    """schemathesis' negative_data_rejection, except a body that only violates the document by a
    type msgspec converts in Litestar's lax mode (strict=False: 0/1 for a boolean, "5" for an
    integer), which the API takes as the converted value: a strict decode fails, a lax one
    succeeds. Any other violation is still checked."""
    struct = BODY_TYPES.get((case.method.upper(), case.operation.path))
    if struct is not None and 200 <= response.status_code < 300 and _only_lax_conversions(case.body, struct):
        return None
    return negative_data_rejection(ctx, response, case)


def _only_lax_conversions(body, struct) -> bool:
    import msgspec

    try:
        msgspec.convert(body, type=struct, strict=True)
        return False
    except msgspec.ValidationError:
        pass
    try:
        msgspec.convert(body, type=struct, strict=False)
        return True
    except (msgspec.ValidationError, TypeError):
        return False


def _json(response):
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def served_openapi_document() -> dict:
    """GET /schema/openapi.json from an app on a throwaway data directory (the document is
    static: it does not depend on the database or the broker)."""
    from litestar.testing import TestClient

    from structspec.api.app import create_app
    from structspec.config import Settings

    with tempfile.TemporaryDirectory(prefix="structspec-openapi-") as tmp:
        with TestClient(create_app(Settings(data_dir=Path(tmp), cache_dir=Path(tmp) / "cache"))) as client:
            response = client.get("/schema/openapi.json")
            assert response.status_code == 200, response.text
            return response.json()


# Loaded when the module is collected: schemathesis turns each operation into a test.
OPENAPI = served_openapi_document()
schema = schemathesis.openapi.from_dict(OPENAPI)


def test_each_app_serves_the_document_under_test(fuzz_app, fuzz_headers):
    from litestar.testing import TestClient

    with TestClient(fuzz_app) as client:
        assert client.get("/schema/openapi.json", headers=fuzz_headers).json() == OPENAPI


def negative_headers(case) -> bool:
    from schemathesis.core.parameters import ParameterLocation

    component = case.meta.components.get(ParameterLocation.HEADER) if case.meta else None
    return component is not None and component.mode.is_negative


def short_wait(case) -> None:
    wait = case.query.get("wait") if isinstance(case.query, dict) else None
    try:
        seconds = float(wait)
    except (TypeError, ValueError):
        return  # not a number: the service answers 422, no waiting
    if seconds > MAX_WAIT_S:
        case.query["wait"] = MAX_WAIT_S


@schema.parametrize()
@hypothesis_settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck), print_blob=False)
def test_api_conforms_to_its_openapi_document(case, fuzz_app, fuzz_headers):
    short_wait(case)
    if negative_headers(case):
        # A case generated to break a header (Authorization, Idempotency-Key) is sent as
        # generated, without the key, and the API must refuse it (401).
        fuzz_headers = {}
    # ignored_auth re-sends the request without its key over HTTP, which an in-process app cannot
    # take; tests/integration/test_auth.py sends every documented /v1 operation without a key.
    case.call_and_validate(app=fuzz_app, headers=fuzz_headers,
                           excluded_checks=[positive_data_acceptance, negative_data_rejection, ignored_auth],
                           additional_checks=[accepts_schema_valid_requests, rejects_schema_violating_requests])


HOSTILE = {"nul": lambda s: s[:1] + "\x00" + s[1:], "over-long": lambda s: s + "x" * 20_000}


def _hostile(value, make):
    """`value` with every string in it (keys too) passed through `make`."""
    if isinstance(value, str):
        return make(value)
    if isinstance(value, dict):
        return {(make(k) if isinstance(k, str) else k): _hostile(v, make) for k, v in value.items()}
    if isinstance(value, list):
        return [_hostile(v, make) for v in value]
    return value


@schema.parametrize()
@hypothesis_settings(max_examples=3, derandomize=True, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck), print_blob=False)
def test_nul_bytes_and_over_long_strings_in_any_parameter_never_answer_5xx(case, fuzz_app, fuzz_headers):
    """Every generated request again with a NUL inside, then 20 000 characters after, each of its
    strings (path and query parameters, body fields and keys): PostgreSQL refused NUL with a 500
    and overflowed a varchar(200) with another before the checks at the edge (issue 30)."""
    short_wait(case)
    original = (dict(case.path_parameters), dict(case.query), case.body)
    for name, make in HOSTILE.items():
        case.path_parameters = {k: _hostile(v, make) for k, v in original[0].items()}  # names stay
        case.query = {k: _hostile(v, make) for k, v in original[1].items()}
        if case.media_type in ("application/json", NDJSON) and original[2] is not None:
            case.body = _hostile(original[2], make)
        response = case.call(app=fuzz_app, headers=fuzz_headers)
        assert response.status_code < 500, (name, case.method, case.formatted_path, response.text[:500])
