"""API keys and tenants.

A key is `ss_` + 43 random URL-safe characters, shown once by `structspec keys create`; only
its SHA-256 is stored. Every /v1 request acts for one tenant: the tenant of its key, or
DEFAULT_TENANT while auth is off. Auth is on as soon as one unrevoked key exists (or with
STRUCTSPEC_REQUIRE_AUTH=1); then a /v1 request without a valid `Authorization: Bearer <key>`
gets 401. A request that sends a key is always checked, auth on or off. /health, /metrics
and the OpenAPI document stay open (they carry no tenant data).

Schemas, jobs, batches and statistics belong to a tenant; the services look everything up
within the caller's tenant, so another tenant's id reads exactly like an unknown one (404).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid

import anyio
from litestar.connection import ASGIConnection
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.middleware.base import DefineMiddleware
from sqlalchemy.orm import Session, sessionmaker

from structspec.api.errors import ApiError, ErrorItem
from structspec.config import Settings
from structspec.db.models import DEFAULT_TENANT, ApiKeyRecord
from structspec.db.repositories import ApiKeyRepository

KEY_PREFIX = "ss_"
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_CHALLENGE = {"www-authenticate": 'Bearer realm="structspec"'}


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def create_key(session_factory: sessionmaker[Session], name: str, tenant: str) -> tuple[ApiKeyRecord, str]:
    """A new key for `tenant`: (its record, the key itself, which is not stored)."""
    if not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"invalid tenant {tenant!r}: 1-64 characters from A-Z a-z 0-9 . _ -")
    if not name.strip() or len(name) > 200:
        raise ValueError("a key's name must be 1-200 characters")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with session_factory.begin() as session:
        record = ApiKeyRepository(session).add(name=name, tenant=tenant, key_hash=hash_key(key),
                                               prefix=key[:len(KEY_PREFIX) + 6])
        session.expunge(record)
    return record, key


def revoke_key(session_factory: sessionmaker[Session], key_id: str) -> ApiKeyRecord | None:
    try:
        kid = uuid.UUID(key_id)
    except ValueError:
        return None
    with session_factory.begin() as session:
        record = ApiKeyRepository(session).revoke(kid)
        if record is not None:
            session.expunge(record)
        return record


def tenant_for(session_factory: sessionmaker[Session], settings: Settings, authorization: str | None,
               any_key_while_open: bool = False) -> str:
    """The tenant a request with this Authorization header acts for; 401 ApiError otherwise.
    `any_key_while_open`: while auth is off, a key is ignored rather than refused (OpenAI
    clients always send one)."""
    if authorization is None or any_key_while_open:
        with session_factory() as session:
            if settings.require_auth or ApiKeyRepository(session).any_active():
                if authorization is None:
                    raise unauthorized("this API needs a key: send `Authorization: Bearer <key>`", "missing")
            else:
                return DEFAULT_TENANT
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("malformed Authorization header: expected `Bearer <key>`", "malformed")
    with session_factory() as session:
        record = ApiKeyRepository(session).active_by_hash(hash_key(key.strip()))
        if record is None:
            raise unauthorized("unknown or revoked API key", "invalid")
        return record.tenant


def unauthorized(detail: str, what: str) -> ApiError:
    return ApiError(401, detail, [ErrorItem(path="Authorization", message=what, source="header")],
                    headers=_CHALLENGE)


class ApiKeyMiddleware(AbstractAuthenticationMiddleware):
    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        state = connection.app.state
        tenant = await anyio.to_thread.run_sync(tenant_for, state.session_factory, state.settings,
                                                connection.headers.get("authorization"),
                                                connection.url.path.startswith(OPENAI_PATH))
        return AuthenticationResult(user=tenant, auth=None)


OPENAI_PATH = "/openai/"  # structspec/api/openai.py

# Everything but /v1 and /openai/v1 is open: health, metrics and the OpenAPI document (/schema/...).
OPEN_PATHS = [r"^/health", r"^/metrics", r"^/schema(/|$)"]
AUTH_MIDDLEWARE = DefineMiddleware(ApiKeyMiddleware, exclude=OPEN_PATHS)

# The OpenAPI name of the scheme (components in api/app.py); every /v1 controller requires it.
SECURITY_SCHEME = "ApiKey"
V1_SECURITY = [{SECURITY_SCHEME: []}]
