"""/health: 200 when the database and the broker answer, 503 naming what does not."""

from __future__ import annotations

from litestar import Controller, MediaType, Response, get
from litestar.datastructures import State
from litestar.openapi.datastructures import ResponseSpec

from structspec.api.structs import HealthFailure, HealthReport


class HealthController(Controller):
    path = "/health"
    tags = ["health"]

    @get("/", sync_to_thread=True, summary="Readiness of database and broker",
         responses={503: ResponseSpec(data_container=HealthFailure, description="a component is down",
                                      generate_examples=False)})
    def health(self, state: State) -> Response[HealthReport]:
        report = state.health.check()
        status = report.status_code if isinstance(report, HealthFailure) else 200
        return Response(report, status_code=status, media_type=MediaType.JSON,
                        headers={"cache-control": "no-store"})
