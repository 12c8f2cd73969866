"""API keys on requests, and tenants.

Every /v1 request acts for one tenant: the tenant of its key, or DEFAULT_TENANT while auth is
off. Auth is on as soon as one unrevoked key exists (or with STRUCTSPEC_REQUIRE_AUTH=1); then a
/v1 request without a valid `Authorization: Bearer <key>` gets 401. A request that sends a key
is always checked, auth on or off. /health, /metrics and the OpenAPI document stay open (they
carry no tenant data). Keys themselves (their format, storage, `structspec keys`) are in
structspec/services/keys.py.

Schemas, jobs, batches and statistics belong to a tenant; the services look everything up
within the caller's tenant, so another tenant's id reads exactly like an unknown one (404).
"""

from __future__ import annotations

import anyio
from litestar.connection import ASGIConnection
from litestar.middleware import AbstractAuthenticationMiddleware, AuthenticationResult
from litestar.middleware.base import DefineMiddleware
from sqlalchemy.orm import Session, sessionmaker

from structspec.api.errors import ApiError, ErrorItem
from structspec.config import Settings
from structspec.db.models import DEFAULT_TENANT
from structspec.services.keys import auth_required, tenant_of

_CHALLENGE = {"www-authenticate": 'Bearer realm="structspec"'}


def tenant_for(session_factory: sessionmaker[Session], settings: Settings, authorization: str | None,
               any_key_while_open: bool = False) -> str:
    """The tenant a request with this Authorization header acts for; 401 ApiError otherwise.
    `any_key_while_open`: while auth is off, a key is ignored rather than refused (OpenAI
    clients always send one)."""
    if authorization is None or any_key_while_open:
        if not auth_required(session_factory, settings):
            return DEFAULT_TENANT
        if authorization is None:
            raise unauthorized("this API needs a key: send `Authorization: Bearer <key>`", "missing")
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise unauthorized("malformed Authorization header: expected `Bearer <key>`", "malformed")
    tenant = tenant_of(session_factory, key.strip())
    if tenant is None:
        raise unauthorized("unknown or revoked API key", "invalid")
    return tenant


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
