"""/v1/extractions: submit one document, list and read jobs, cancel and delete one."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

import anyio
import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import JSONBody, Parameter, PathParameter, QueryParameter

from structspec.api.auth import V1_SECURITY
from structspec.api.schemas import MAX_OFFSET, _errors
from structspec.api.services.jobs import Idempotency, JobService, to_job_read
from structspec.api.services.waiting import unless_disconnected
from structspec.api.structs import ExtractionCreate, JobAccepted, JobPage, JobRead

JobId = Annotated[str, PathParameter(description="job id (UUID)")]
# on an answer that replays the first one given to its Idempotency-Key
REPLAYED = {"idempotent-replayed": "true"}
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
Limit = Annotated[int, QueryParameter(ge=1, le=500, description="items per page")]
Offset = Annotated[int, QueryParameter(ge=0, le=MAX_OFFSET, description="items skipped")]
IdempotencyKey = Annotated[str | None, Parameter(
    header="idempotency-key", min_length=1, max_length=255, required=False,
    description="any unique string (a UUID): the same submission sent again with it within 24 hours is "
                "answered as the first was, creating nothing new; with a different request it is 422")]
Jobs = NamedDependency[JobService]


def provide_job_service(state: State, request: Request) -> JobService:
    return JobService(state.session_factory, state.settings, state.publisher, state.doclen, tenant=request.user)


class ExtractionController(Controller):
    path = "/v1/extractions"
    tags = ["extractions"]
    security = V1_SECURITY
    dependencies = {"jobs": Provide(provide_job_service, sync_to_thread=False)}

    @post("/", status_code=202, summary="Submit one document for extraction",
          description="202 {id, status} once queued. With ?wait=S (0-60) the call waits up to S seconds "
                      "and answers 200 with the finished job, or 202 if it is not finished by then. "
                      "A client that disconnects while waiting leaves the job running.",
          responses={200: ResponseSpec(data_container=JobRead, description="finished within `wait`",
                                       generate_examples=False), **_errors(400, 404, 413, 415, 422, 503)})
    async def submit(self, request: Request, state: State, data: JSONBody[ExtractionCreate], jobs: Jobs,
                     idempotency_key: IdempotencyKey = None,
                     # schema_extra: Litestar drops ge=0 from the document for an optional float
                     wait: Annotated[float | None, QueryParameter(ge=0, le=60, schema_extra={"minimum": 0})] = None,
                     ) -> Response[JobAccepted]:
        idem = Idempotency.of(idempotency_key, "POST /v1/extractions", msgspec.json.encode(data))
        accepted, replayed = await anyio.to_thread.run_sync(jobs.submit, data, idem)
        headers = REPLAYED if replayed else None
        if wait:
            job, _ = await unless_disconnected(request.receive,
                                               lambda: jobs.wait_finished(state.waiter, accepted.id, wait))
            if job is not None and job.finished_at is not None:
                return Response(to_job_read(job), status_code=200, headers=headers)
        return Response(accepted, status_code=202, headers=headers)

    @get("/", sync_to_thread=True, summary="List jobs, newest first (summaries: no document or result)",
         responses=_errors(422))
    def list_jobs(self, jobs: Jobs, limit: Limit = 50, offset: Offset = 0,
                  status: Annotated[JobStatus | None, QueryParameter(description="only this status")] = None,
                  batch_id: Annotated[uuid.UUID | None, QueryParameter(description="only this batch's jobs")] = None,
                  schema_id: Annotated[uuid.UUID | None, QueryParameter(description="only this schema version's jobs")]
                  = None) -> JobPage:
        return jobs.list(limit=limit, offset=offset, status=status, batch_id=batch_id, schema_id=schema_id)

    @get("/{job_id:str}", sync_to_thread=True, summary="One job: status, result or error, stats",
         responses=_errors(404))
    def get_job(self, job_id: JobId, jobs: Jobs) -> JobRead:
        return jobs.get(job_id)

    @post("/{job_id:str}/cancel", sync_to_thread=True, status_code=200, summary="Cancel a queued or running job",
          responses=_errors(404, 409))
    def cancel(self, job_id: JobId, jobs: Jobs) -> JobRead:
        return jobs.cancel(job_id)

    @delete("/{job_id:str}", sync_to_thread=True, status_code=204,
            summary="Delete a job: its document, result and stats (a queued or running one stops)",
            description="A job of a batch is deleted with its batch (409 here).", responses=_errors(404, 409))
    def delete_job(self, job_id: JobId, jobs: Jobs) -> None:
        jobs.delete(job_id)
