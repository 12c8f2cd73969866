"""/v1/batches: bulk submission (JSON or NDJSON), list, progress, ordered NDJSON results,
cancel, delete."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated

import anyio
import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, Reference, RequestBody, Schema
from litestar.params import PathParameter, QueryParameter
from litestar.response import Response, Stream

from structspec.api.auth import V1_SECURITY
from structspec.api.errors import BadRequestError, ErrorItem, UnprocessableError
from structspec.api.extractions import REPLAYED, IdempotencyKey, Limit, Offset, provide_job_service
from structspec.api.schemas import _errors
from structspec.api.services.jobs import Idempotency, JobService
from structspec.api.services.waiting import unless_disconnected
from structspec.api.structs import (NO_NUL, BatchAccepted, BatchCreate, BatchPage, BatchRead, JobOptions,
                                    option_keywords)

BatchId = Annotated[str, PathParameter(description="batch id (UUID)")]
Jobs = NamedDependency[JobService]
NDJSON = "application/x-ndjson"
# the query parameters of an NDJSON batch (the submit handler's): anything else is a typo, refused
NDJSON_PARAMETERS = frozenset({"schema_id", "strategy", "draft_len", "temperature", "seed", "max_tokens", "verbatim",
                               "chunking", "timeout_s", "webhook_url"})
_OPTION = "NDJSON body only (a JSON body carries its options)"

# The request body, for the document only: the handler reads the raw body itself (NDJSON is
# not JSON). Entries are documented as they should be; a bad one is reported in `rejected`.
_ID = Schema(one_of=[Schema(type=OpenAPIType.STRING), Schema(type=OpenAPIType.INTEGER)])
_ENTRY = Schema(one_of=[
    Schema(type=OpenAPIType.OBJECT, required=["document"], additional_properties=False,
           properties={"id": _ID, "document": Schema(type=OpenAPIType.STRING, pattern=NO_NUL, description="the text")}),
    Schema(type=OpenAPIType.OBJECT, required=["content"], additional_properties=False,
           properties={"id": _ID,
                       "content": Schema(type=OpenAPIType.STRING, description="the document's file, base64: a PDF, "
                                         "an image (PNG, JPEG, TIFF; read by OCR) or UTF-8 text"),
                       "media_type": Schema(type=OpenAPIType.STRING, max_length=200,
                                            description="the file's media type; its first bytes decide first")}),
    Schema(type=OpenAPIType.OBJECT, required=["file_id"], additional_properties=False,
           properties={"id": _ID,
                       "file_id": Schema(type=OpenAPIType.STRING, max_length=40,
                                         description="an uploaded file (POST /v1/files, purpose user_data)"),
                       "media_type": Schema(type=OpenAPIType.STRING, max_length=200,
                                            description="the file's media type; its first bytes decide first")})])
BATCH_BODY = RequestBody(required=True, content={
    "application/json": OpenAPIMediaType(schema=Schema(
        type=OpenAPIType.OBJECT, required=["documents", "schema_id"], additional_properties=False,
        properties={"schema_id": Schema(type=OpenAPIType.STRING),
                    "documents": Schema(type=OpenAPIType.ARRAY, items=_ENTRY, min_items=1),
                    "options": Schema(one_of=[Reference(ref="#/components/schemas/JobOptions"),
                                              Schema(type=OpenAPIType.NULL)]),
                    "webhook_url": Schema(one_of=[Schema(type=OpenAPIType.STRING, max_length=2048),
                                                  Schema(type=OpenAPIType.NULL)])})),
    NDJSON: OpenAPIMediaType(schema=Schema(
        type=OpenAPIType.STRING, description='one {"id"?: string | integer, "document": string} or {"id"?, '
                                             '"content": base64, "media_type"?: string} per line')),
})


@dataclass
class BatchSubmitOperation(Operation):
    def __post_init__(self) -> None:
        self.request_body = BATCH_BODY


class BatchController(Controller):
    path = "/v1/batches"
    tags = ["batches"]
    security = V1_SECURITY
    dependencies = {"jobs": Provide(provide_job_service, sync_to_thread=False)}

    @post("/", status_code=202, summary="Submit a batch of documents",
          description="JSON {schema_id, documents: [{id?, document} | {id?, content, media_type?}], options?, "
                      "webhook_url?}, or an NDJSON body (Content-Type application/x-ndjson, one entry per line) "
                      "with schema_id, options and webhook_url as query parameters. A document is text "
                      "(`document`), a file (`content`, base64: PDF, PNG, JPEG, TIFF) or an uploaded file "
                      "(`file_id`); a file is checked while the request waits and read by a worker (the job's "
                      "phase is `reading` until then). Bad entries are listed in `rejected`.",
          responses=_errors(400, 404, 413, 422, 503), operation_class=BatchSubmitOperation)
    async def submit(
            self, request: Request, jobs: Jobs, idempotency_key: IdempotencyKey = None,
            schema_id: Annotated[str | None, QueryParameter(description="schema version id (UUID); " + _OPTION)] = None,
            strategy: Annotated[str | None, QueryParameter(description=_OPTION,
                                                           schema_extra=option_keywords("strategy"))] = None,
            draft_len: Annotated[int | None, QueryParameter(description=_OPTION,
                                                            schema_extra=option_keywords("draft_len"))] = None,
            temperature: Annotated[float | None, QueryParameter(description=_OPTION,
                                                                schema_extra=option_keywords("temperature"))] = None,
            seed: Annotated[int | None, QueryParameter(description=_OPTION, schema_extra=option_keywords("seed"))] = None,
            max_tokens: Annotated[int | None, QueryParameter(description=_OPTION,
                                                             schema_extra=option_keywords("max_tokens"))] = None,
            verbatim: Annotated[bool | None, QueryParameter(description=_OPTION)] = None,
            chunking: Annotated[str | None, QueryParameter(description=_OPTION,
                                                           schema_extra=option_keywords("chunking"))] = None,
            timeout_s: Annotated[int | None, QueryParameter(description=_OPTION,
                                                            schema_extra=option_keywords("timeout_s"))] = None,
            webhook_url: Annotated[str | None, QueryParameter(description=_OPTION, max_length=2048)] = None
    ) -> Response[BatchAccepted]:
        # The raw body: NDJSON is not JSON, and Litestar would decode a JSON body as one object.
        data = await request.body()
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        idem = Idempotency.of(idempotency_key, "POST /v1/batches", content_type.encode(),
                              str(sorted(request.query_params.multi_items())).encode(), data)
        if content_type in (NDJSON, "application/jsonl", "application/ndjson"):
            unknown = sorted(set(request.query_params) - NDJSON_PARAMETERS)
            if unknown:
                raise UnprocessableError(
                    f"unknown query parameter {unknown[0]!r}; an NDJSON batch takes "
                    f"{', '.join(sorted(NDJSON_PARAMETERS))}",
                    [ErrorItem(path=name, message="unknown query parameter", source="query") for name in unknown])
            options = JobOptions(strategy=strategy, draft_len=draft_len, temperature=temperature, seed=seed,
                                 max_tokens=max_tokens, verbatim=verbatim, chunking=chunking, timeout_s=timeout_s)
            accepted, replayed = await anyio.to_thread.run_sync(jobs.submit_batch_ndjson, data, schema_id, options,
                                                                idem, webhook_url)
        else:
            accepted, replayed = await anyio.to_thread.run_sync(jobs.submit_batch_json, decode_batch(data), idem)
        return Response(accepted, status_code=202, headers=REPLAYED if replayed else None)

    @get("/", sync_to_thread=True, summary="List batches, newest first, with their counts and status",
         responses=_errors(422))
    def list_batches(self, jobs: Jobs, limit: Limit = 50, offset: Offset = 0,
                     schema_id: Annotated[uuid.UUID | None, QueryParameter(description="only this schema version's")]
                     = None) -> BatchPage:
        return jobs.list_batches(limit=limit, offset=offset, schema_id=schema_id)

    @get("/{batch_id:str}", summary="Batch progress: counts per status",
         description="With ?wait=S (0-60) the call answers once the batch has finished (`finished_at` set) or "
                     "after S seconds, whichever comes first: a client waiting for a batch needs no polling "
                     "loop of its own, and sees the end as soon as it comes.",
         responses=_errors(404, 422))
    async def get_batch(self, request: Request, state: State, batch_id: BatchId, jobs: Jobs,
                        # schema_extra: Litestar drops ge=0 from the document for an optional float
                        wait: Annotated[float | None, QueryParameter(ge=0, le=60, schema_extra={"minimum": 0})] = None,
                        ) -> BatchRead:
        if not wait:
            return await anyio.to_thread.run_sync(jobs.get_batch, batch_id)
        batch, _ = await unless_disconnected(request.receive, lambda: jobs.wait_batch(state.waiter, batch_id, wait))
        return batch  # None only when the client went away: nobody reads it

    @get("/{batch_id:str}/results", sync_to_thread=True, media_type=NDJSON,
         summary="NDJSON {id, status, result | error, stats} per document, in input order",
         responses=_errors(404))
    def results(self, batch_id: BatchId, jobs: Jobs) -> Stream:
        return Stream(jobs.batch_results(batch_id), media_type=NDJSON)

    @post("/{batch_id:str}/cancel", sync_to_thread=True, status_code=200, summary="Cancel the batch's unfinished jobs",
          responses=_errors(404))
    def cancel(self, batch_id: BatchId, jobs: Jobs) -> BatchRead:
        return jobs.cancel_batch(batch_id)

    @delete("/{batch_id:str}", sync_to_thread=True, status_code=204,
            summary="Delete a batch and its jobs: documents, results and stats (unfinished ones stop)",
            description="409 for the batch behind an OpenAI-format batch.", responses=_errors(404, 409))
    def delete_batch(self, batch_id: BatchId, jobs: Jobs) -> None:
        jobs.delete_batch(batch_id)


def decode_batch(body: bytes) -> BatchCreate:
    """The JSON form, with the API's 400 (not JSON) / 422 (wrong shape) split."""
    if not body.strip():
        raise BadRequestError("request body is required (a JSON object)",
                              [ErrorItem(message="request body is empty", source="body")])
    try:
        # strict=False: the same conversions as the bodies Litestar decodes (e.g. 49.0 for an integer)
        return msgspec.json.decode(body, type=BatchCreate, strict=False)
    except msgspec.ValidationError as e:
        path = _path(str(e))
        raise UnprocessableError(f"invalid request body: {e}", [ErrorItem(path=path, message=str(e), source="body")]) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BadRequestError(f"request body is not valid JSON: {e}", [ErrorItem(message=str(e), source="body")]) from None


def _path(message: str) -> str:
    # msgspec: "... - at `$.documents[0]`" -> /documents/0
    if "at `$" not in message:
        return ""
    loc = message.rsplit("at `$", 1)[1].rstrip("`")
    return "".join("/" + p for p in loc.replace("[", ".").replace("]", "").split(".") if p)
