"""/metrics: Prometheus text exposition, read from the database at scrape time."""

from __future__ import annotations

from litestar import Controller, Response, get
from litestar.datastructures import State

from structspec.api.services.stats import StatsService
from structspec.stats.metrics import CONTENT_TYPE


class MetricsController(Controller):
    path = "/metrics"
    tags = ["metrics"]

    @get("/", sync_to_thread=True, summary="Prometheus metrics (counters per schema and strategy, job latency)",
         include_in_schema=True, media_type=CONTENT_TYPE)
    def metrics(self, state: State) -> Response[bytes]:
        body = StatsService(state.session_factory, state.settings).metrics()
        return Response(body, media_type=CONTENT_TYPE)
