"""The OpenAI-compatible surface, mounted under /openai/v1 so that it cannot clash with
structspec's own /v1 routes (its /v1/batches in particular): clients set
`base_url="http://host:8000/openai/v1"` and keep their code.

    POST /openai/v1/chat/completions         response_format json_schema | json_object; one job,
                                             waited on, or streamed as SSE with stream: true
    GET  /openai/v1/models                   the served model
    POST /openai/v1/files                    multipart upload: a batch input (purpose batch) or a
                                             document for a message's file part (purpose user_data)
    GET  /openai/v1/files[/{id}[/content]]   list, a file's object, or its bytes
    DELETE /openai/v1/files/{id}
    POST /openai/v1/batches                  OpenAI's Batch format, endpoint /v1/chat/completions
    GET  /openai/v1/batches[/{id}]           list (newest first), or one
    POST /openai/v1/batches/{id}/cancel

Each request runs as one extraction job through the usual machinery (API keys, tenants, rate
and size limits, the per-schema statistics and `auto`); its prompt is the request's messages
through the model's chat template, their text as data (engine/prompt.py); a message's file
parts (a PDF or an image, inline or uploaded) become the text structspec.ingest reads from
them. What the routes do is in api/services/openai.py. Errors take OpenAI's shape, {"error":
{"message", "type", "param", "code"}}, so SDK exceptions carry the message (`openai_error`,
chosen by path in api/app.py).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator

import anyio
import msgspec
from litestar import Controller, MediaType, Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.params import JSONBody
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse

from structspec.api.errors import ApiError, ErrorBody, handle_exception
from structspec.api.extractions import REPLAYED, provide_job_service
from structspec.api.uploads import read_upload
from structspec.api.services.jobs import Idempotency, JobService
from structspec.api.services.openai import (ChatRequest, OpenAIBatchService, bad_request, completion, error_object,
                                            flatten, read_chat_request, served_model, stream_chunks)
from structspec.api.services.waiting import unless_disconnected, until_disconnected
from structspec.config import Settings

PREFIX = "/openai/v1"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def batch_service(state: State, request: Request) -> OpenAIBatchService:
    return OpenAIBatchService(provide_job_service(state, request))


class EventStream(ASGIStreamingResponse):
    """Server-sent events: `data: {json}` per chunk of `chunks` (an async iterator that holds no
    thread while it waits), then `data: [DONE]`. The iterator is closed when the stream ends for
    any reason, the client disconnecting included, so its cleanup runs then."""

    def __init__(self, chunks: AsyncIterator[dict[str, Any]]):
        super().__init__(iterator=(), media_type="text/event-stream", headers=SSE_HEADERS)  # no content-length
        self.chunks = chunks

    async def send_body(self, send, receive) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch_disconnect, receive, group.cancel_scope)
                async for chunk in self.chunks:
                    data = b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.chunks.aclose()

    @staticmethod
    async def _watch_disconnect(receive, scope: anyio.CancelScope) -> None:
        await until_disconnected(receive)
        scope.cancel()


class OpenAIController(Controller):
    """Left out of structspec's OpenAPI document: its contract is OpenAI's API reference."""

    path = PREFIX
    include_in_schema = False

    @post("/chat/completions", status_code=200,
          summary="OpenAI-compatible chat completion with a JSON response_format")
    async def chat_completions(self, request: Request, state: State, data: JSONBody[dict[str, Any]]) -> ASGIResponse:
        jobs: JobService = provide_job_service(state, request)
        settings: Settings = state.settings
        model = served_model(settings.model)

        def submit() -> tuple[ChatRequest, uuid.UUID]:
            chat = read_chat_request(data, jobs)
            return chat, jobs.submit_chat(chat.schema, chat.messages, chat.options, stream=chat.stream,
                                          registered_by=f"POST {PREFIX}/chat/completions", files=chat.files)

        chat, job_id = await anyio.to_thread.run_sync(submit)
        if chat.stream:
            # ASGI responses, not litestar's Stream (which would take the route's media type, JSON)
            return EventStream(stream_chunks(jobs, state.waiter, job_id, model, settings.chat_timeout_s,
                                             chat.include_usage))
        job, gone = await unless_disconnected(
            request.receive, lambda: jobs.wait_finished(state.waiter, job_id, settings.chat_timeout_s))
        if gone:  # nobody can read this reply: stop the job, as a streamed one is stopped
            await anyio.to_thread.run_sync(jobs.cancel_quietly, job_id)
            return ASGIResponse(body=b"", status_code=499)
        if job.finished_at is None:
            raise ApiError(504, f"the extraction did not finish within {settings.chat_timeout_s} s "
                                f"(STRUCTSPEC_CHAT_TIMEOUT_S); job {job_id} goes on: GET /v1/extractions/{job_id}")
        return ASGIResponse(body=json.dumps(completion(job, model), ensure_ascii=False).encode(),
                            media_type=MediaType.JSON)

    @get("/models", sync_to_thread=False, summary="The served model (OpenAI's model list)")
    def models(self, state: State) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model(state.settings.model), "object": "model",
                                            "created": int(time.time()), "owned_by": "structspec"}]}

    # --- files ---------------------------------------------------------------------------------

    # no body limit here: the upload is counted as it streams, against max_file_bytes (api/uploads.py)
    @post("/files", status_code=200, request_max_body_size=None, summary="Upload a file (multipart: file, purpose)",
          description="purpose batch: a batch's JSONL input; purpose user_data: a document (PDF, PNG, JPEG, TIFF "
                      "or text) that a chat message's file part names by file_id. Streamed to the file store "
                      "(shared with /v1/files); at most max_file_bytes.")
    async def upload_file(self, request: Request, state: State) -> dict[str, Any]:
        upload = await read_upload(request, state.settings.max_file_bytes)
        try:
            purpose = upload.fields.get("purpose")
            if upload.file is None:
                raise bad_request("a multipart field `file` holding the file is required", "file")
            if purpose is None:
                raise bad_request("a multipart field `purpose` is required (batch or user_data)", "purpose")
            if "\x00" in (upload.filename or ""):
                raise bad_request("the file name holds U+0000 (NUL)", "file")
            service = batch_service(state, request)
            return await anyio.to_thread.run_sync(service.upload, upload, purpose)
        finally:
            upload.close()

    @get("/files", sync_to_thread=True, summary="The tenant's files, newest first")
    def list_files(self, request: Request, state: State, purpose: str | None = None, after: str | None = None,
                   limit: int = 10_000) -> dict[str, Any]:
        return batch_service(state, request).files(purpose, after, limit)

    @delete("/files/{file_id:str}", sync_to_thread=True, status_code=200, summary="Delete a file")
    def delete_file(self, request: Request, state: State, file_id: str) -> dict[str, Any]:
        return batch_service(state, request).delete_file(file_id)

    @get("/files/{file_id:str}", sync_to_thread=True, summary="A file's object")
    def get_file(self, request: Request, state: State, file_id: str) -> dict[str, Any]:
        return batch_service(state, request).file(file_id)

    @get("/files/{file_id:str}/content", sync_to_thread=True, summary="A file's bytes",
         media_type="application/octet-stream")
    def file_content(self, request: Request, state: State, file_id: str) -> bytes:
        return batch_service(state, request).file_content(file_id)

    # --- batches -------------------------------------------------------------------------------

    @post("/batches", sync_to_thread=True, status_code=200, summary="Create a batch from an uploaded file")
    def create_batch(self, request: Request, state: State, data: JSONBody[dict[str, Any]]) -> Response[dict[str, Any]]:
        key = request.headers.get("idempotency-key")
        if key is not None and not 1 <= len(key) <= 255:
            raise bad_request("the Idempotency-Key header must be 1 to 255 characters", "Idempotency-Key")
        idem = Idempotency.of(key, f"POST {PREFIX}/batches", msgspec.json.encode(data))
        batch, replayed = batch_service(state, request).create(data, idem)
        return Response(batch, headers=REPLAYED if replayed else None)

    @get("/batches", sync_to_thread=True, summary="The tenant's batches, newest first")
    def list_batches(self, request: Request, state: State, after: str | None = None,
                     limit: int = 20) -> dict[str, Any]:
        return batch_service(state, request).list(after, limit)

    @get("/batches/{batch_id:str}", sync_to_thread=True, summary="A batch: status, counts, files")
    def get_batch(self, request: Request, state: State, batch_id: str) -> dict[str, Any]:
        return batch_service(state, request).get(batch_id)

    @post("/batches/{batch_id:str}/cancel", sync_to_thread=True, status_code=200, summary="Cancel a batch")
    def cancel_batch(self, request: Request, state: State, batch_id: str) -> dict[str, Any]:
        return batch_service(state, request).cancel(batch_id)


def openai_error(request: Request, exc: Exception) -> Response:
    """structspec's error for `exc` (errors.handle_exception), in OpenAI's shape."""
    response = handle_exception(request, exc)
    body: ErrorBody = response.content
    return Response(error_body(body.status_code, *flatten(body.detail, body.errors)),
                    status_code=body.status_code, headers=response.headers, media_type=MediaType.JSON)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error response body."""
    return {"error": error_object(status, message, param, code)}
