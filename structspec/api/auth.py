"""API keys on requests, and tenants.

Every /v1 request acts for one tenant: the tenant of its key, or DEFAULT_TENANT while auth is
off. Auth is on as soon as one unrevoked key exists (or with STRUCTSPEC_REQUIRE_AUTH=1); then a
/v1 request without a valid `Authorization: Bearer <key>` gets 401. A request that sends a key
is always checked, auth on or off. A refused Authorization header counts against its client
address's failed-authentication budget (api/ratelimit.py), so keys cannot be guessed at speed.
/health, /metrics and the OpenAPI document stay open (they carry no tenant data). Keys themselves (their format, storage, `structspec keys`) are in
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
from structspec.api.ratelimit import failure_identity, key_identity
from structspec.config import Settings
from structspec.db.models import DEFAULT_TENANT
from structspec.services.keys import auth_required, bearer_key, tenant_of

_CHALLENGE = {"www-authenticate": 'Bearer realm="structspec"'}


def tenant_for(session_factory: sessionmaker[Session], settings: Settings, authorization: str | None,
               any_key_while_open: bool = False) -> tuple[str, str | None]:
    """The tenant a request with this Authorization header acts for, and the key it was found by
    (None when no key was used); 401 ApiError otherwise. `any_key_while_open`: while auth is
    off, a key is ignored rather than refused (OpenAI clients always send one)."""
    if authorization is None or any_key_while_open:
        if not auth_required(session_factory, settings):
            return DEFAULT_TENANT, None
        if authorization is None:
            raise unauthorized("this API needs a key: send `Authorization: Bearer <key>`", "missing")
    key = bearer_key(authorization)
    if key is None:
        raise unauthorized("malformed Authorization header: expected `Bearer <key>`", "malformed")
    tenant = tenant_of(session_factory, key)
    if tenant is None:
        raise unauthorized("unknown or revoked API key", "invalid")
    return tenant, key


def unauthorized(detail: str, what: str) -> ApiError:
    return ApiError(401, detail, [ErrorItem(path="Authorization", message=what, source="header")],
                    headers=_CHALLENGE)


class ApiKeyMiddleware(AbstractAuthenticationMiddleware):
    """The tenant of a request's key. It also feeds the meters of api/ratelimit.py, which ran
    before it: a key that authenticates gets a request bucket of its own (made-up keys never
    do), and a refused Authorization header counts against its client address."""

    async def authenticate_request(self, connection: ASGIConnection) -> AuthenticationResult:
        state = connection.app.state
        authorization = connection.headers.get("authorization")
        try:
            tenant, key = await anyio.to_thread.run_sync(tenant_for, state.session_factory, state.settings,
                                                         authorization, connection.url.path.startswith(OPENAI_PATH))
        except ApiError as e:
            if e.status_code == 401 and authorization is not None:  # a header sent and refused: a guess
                state.auth_failures.take(failure_identity(connection.scope))
            raise
        if key is not None:
            state.rate_limiter.admit(key_identity(key))
        return AuthenticationResult(user=tenant, auth=None)


OPENAI_PATH = "/openai/"  # structspec/api/openai.py

# Everything but /v1 and /openai/v1 is open: health, metrics and the OpenAPI document (/schema/...).
OPEN_PATHS = [r"^/health", r"^/metrics", r"^/schema(/|$)"]
AUTH_MIDDLEWARE = DefineMiddleware(ApiKeyMiddleware, exclude=OPEN_PATHS)

# The OpenAPI name of the scheme (components in api/app.py); every /v1 controller requires it.
SECURITY_SCHEME = "ApiKey"
V1_SECURITY = [{SECURITY_SCHEME: []}]
