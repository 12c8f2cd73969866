"""Litestar application factory. The API process holds no model: it stores schemas and
(later) enqueues jobs for workers; nothing here imports torch at startup."""

from __future__ import annotations

import logging

from litestar import Litestar
from litestar.routes import HTTPRoute
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from litestar.openapi.plugins import JsonRenderPlugin, SwaggerRenderPlugin, YamlRenderPlugin

from structspec.api.auth import AUTH_MIDDLEWARE, SECURITY_SCHEME
from structspec.api.batches import BatchController
from structspec.api.errors import handle_exception
from structspec.api.extractions import ExtractionController
from structspec.api.files import FileController
from structspec.api.guard import check_request
from structspec.api.health import HealthController
from structspec.api.metrics import MetricsController
from structspec.api.openai import PREFIX as OPENAI_PREFIX, OpenAIController, openai_error
from structspec.api.openapi import StrictStructSchemaPlugin
from structspec.api.ratelimit import RateLimiter, RateLimitMiddleware
from structspec.api.schemas import SchemaController
from structspec.api.services.doclen import DocumentLengthChecker
from structspec.api.services.health import HealthService
from structspec.api.services.probecache import ProbeCache
from structspec.api.services.waiting import JobWaiter
from structspec.config import Settings
from structspec.db.session import make_engine, make_session_factory

log = logging.getLogger("structspec.api")

API_VERSION = "0.1.0"


def handle_any_exception(request, exc: Exception):
    """Errors in structspec's shape, or in OpenAI's under /openai/v1."""
    if request.url.path.startswith(OPENAI_PREFIX + "/"):
        return openai_error(request, exc)
    return handle_exception(request, exc)


def create_app(settings: Settings | None = None) -> Litestar:
    """The app for `settings` (default Settings.from_env()). The database must be migrated
    (`structspec migrate`; `structspec serve` does it first)."""
    settings = settings or Settings.from_env()
    engine = make_engine(settings.database_url)
    health = HealthService(engine, settings.broker_url)
    from structspec.worker.app import make_celery  # celery only, no torch: publishes job ids

    publisher = make_celery(settings)
    limiter = RateLimiter(settings.rate_limit_per_minute, settings.rate_limit_burst)
    auth_failures = RateLimiter(settings.auth_failures_per_minute, settings.auth_failure_burst,
                                settings="auth_failures_per_minute, auth_failure_burst")
    doclen = DocumentLengthChecker(settings)  # loads the tokenizer at the first submission
    waiter = JobWaiter(engine, settings.database_url)  # what waiting requests sleep on

    def shutdown() -> None:
        health.close()
        publisher.pool.force_close_all()
        engine.dispose()

    return Litestar(
        route_handlers=[SchemaController, ExtractionController, BatchController, FileController, HealthController,
                        MetricsController, OpenAIController],
        state=State({"settings": settings, "engine": engine,
                     "session_factory": make_session_factory(engine), "health": health,
                     "publisher": publisher, "rate_limiter": limiter, "auth_failures": auth_failures,
                     "doclen": doclen, "waiter": waiter, "metrics_cache": ProbeCache()}),
        # Outermost first: both meters answer before auth looks a key up (api/ratelimit.py).
        middleware=[RateLimitMiddleware(limiter, auth_failures), AUTH_MIDDLEWARE],
        exception_handlers={Exception: handle_any_exception},
        before_request=check_request,  # NUL and lone surrogates: 400 before any handler parses the request
        plugins=[StrictStructSchemaPlugin()],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=OpenAPIConfig(
            title="structspec", version=API_VERSION, path="/schema",
            description="Register JSON Schemas; get schema-valid JSON extracted from documents.",
            components=Components(security_schemes={SECURITY_SCHEME: SecurityScheme(
                type="http", scheme="bearer",
                description="An API key from `structspec keys create`; needed on /v1 once a key exists.")}),
            render_plugins=[SwaggerRenderPlugin(), JsonRenderPlugin(), YamlRenderPlugin()]),
        on_startup=[waiter.start],
        on_shutdown=[waiter.stop, shutdown],
        before_send=[allow_every_method],
        # Leave logging to the host process (the CLI's basicConfig, uvicorn, pytest): Litestar's
        # default config would set the root logger to INFO and print every library's chatter.
        logging_config=None,
        debug=False,
    )


async def allow_every_method(message, scope) -> None:
    """`Allow` on an OPTIONS answer lists every method of the path. Litestar 2.25's automatic
    OPTIONS handler belongs to the route built for the path's first handler and lists only its
    methods (OPTIONS /v1/schemas said `GET, OPTIONS`, without POST)."""
    if message["type"] != "http.response.start" or scope.get("method") != "OPTIONS":
        return
    allowed = _allowed_methods(scope["litestar_app"]).get(scope.get("path_template"))
    if allowed:
        message["headers"] = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
        message["headers"].append((b"allow", allowed.encode()))


def _allowed_methods(app: Litestar) -> dict[str, str]:
    table = app.state.get("_allowed_methods")
    if table is None:
        table = {r.path_format: ", ".join(sorted(r.methods)) for r in app.routes if isinstance(r, HTTPRoute)}
        app.state["_allowed_methods"] = table
    return table


def create_app_from_env() -> Litestar:
    """Zero-argument factory for `uvicorn --factory structspec.api.app:create_app_from_env`."""
    return create_app(Settings.from_env())
