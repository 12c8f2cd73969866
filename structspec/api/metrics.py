"""/metrics: Prometheus text exposition, read from the database at scrape time (the body cached
for a second per process, api/services/probecache.py: a flood of scrapes reads it once a second).

Open by default, with totals per strategy only: nothing in it names or identifies a tenant's
schema. With STRUCTSPEC_METRICS_TOKEN set it needs `Authorization: Bearer <token>` (401
otherwise; an API key does not do) and breaks the totals down per tenant and schema."""

from __future__ import annotations

import hmac

from litestar import Controller, Request, Response, get
from litestar.datastructures import State

from structspec.api.errors import ApiError, ErrorItem
from structspec.api.services.stats import StatsService
from structspec.stats.metrics import CONTENT_TYPE


class MetricsController(Controller):
    path = "/metrics"
    tags = ["metrics"]

    @get("/", sync_to_thread=True, summary="Prometheus metrics (counters per strategy, job latency, backlog)",
         description="Open with totals per strategy; with STRUCTSPEC_METRICS_TOKEN set, needs that token as a "
                     "Bearer and adds per-tenant, per-schema series.",
         include_in_schema=True, media_type=CONTENT_TYPE)
    def metrics(self, request: Request, state: State) -> Response[bytes]:
        token = state.settings.metrics_token
        if token:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                raise ApiError(401, "/metrics needs the operator's token (STRUCTSPEC_METRICS_TOKEN) as a Bearer",
                               [ErrorItem(path="Authorization", message="missing" if not given else "invalid",
                                          source="header")], headers={"www-authenticate": "Bearer"})
        per_schema = bool(token)  # the token is checked above, on every scrape
        body = state.metrics_cache.get(per_schema, lambda: StatsService(state.session_factory, state.settings)
                                       .metrics(per_schema=per_schema))
        return Response(body, media_type=CONTENT_TYPE)
