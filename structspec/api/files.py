"""/v1/files: upload a document (multipart, streamed to the file store), list, read, download,
delete. A batch entry or an extraction names an uploaded file by its id (`file_id`), so a batch
of fifty scans is a small JSON body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import anyio
from litestar import Controller, Request, delete, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIType, Operation, RequestBody, Schema
from litestar.params import PathParameter, QueryParameter
from litestar.response import Stream

from structspec.api.auth import V1_SECURITY
from structspec.api.errors import ApiError, ErrorItem
from structspec.api.schemas import _errors
from structspec.api.services.files import FileService
from structspec.api.structs import FilePage, FileRead
from structspec.api.uploads import read_upload
from structspec.db.files import DOCUMENT_PURPOSE

FileId = Annotated[str, PathParameter(description="file id (file-<hex>)")]
Files = NamedDependency[FileService]


# The body, for the document only: the handler reads the multipart stream itself (api/uploads.py).
UPLOAD_BODY = RequestBody(required=True, content={"multipart/form-data": OpenAPIMediaType(schema=Schema(
    type=OpenAPIType.OBJECT, required=["file"], additional_properties=False,
    properties={"file": Schema(type=OpenAPIType.STRING, format="binary",
                               description="the document: a PDF, PNG, JPEG, TIFF or text file"),
                "purpose": Schema(type=OpenAPIType.STRING, enum=[DOCUMENT_PURPOSE], description="user_data (the default)")}))})


@dataclass
class UploadOperation(Operation):
    def __post_init__(self) -> None:
        self.request_body = UPLOAD_BODY


def provide_file_service(state: State, request: Request) -> FileService:
    return FileService(state.session_factory, state.settings, tenant=request.user)


class FileController(Controller):
    path = "/v1/files"
    tags = ["files"]
    security = V1_SECURITY
    dependencies = {"files": Provide(provide_file_service, sync_to_thread=False)}

    # no body limit here: the upload is counted as it streams, against max_file_bytes
    @post("/", status_code=201, request_max_body_size=None, summary="Upload a document (multipart: file)",
          description="multipart/form-data with a `file` part (a PDF, PNG, JPEG, TIFF or text file) and an optional "
                      "`purpose` (user_data, the default). Streamed to the file store; at most max_file_bytes. "
                      "Give its id as `file_id` in POST /v1/extractions or in a batch entry.",
          responses=_errors(400, 413, 415, 422), operation_class=UploadOperation)
    async def upload(self, request: Request, state: State, files: Files) -> FileRead:
        upload = await read_upload(request, state.settings.max_file_bytes)
        try:
            unknown = sorted(set(upload.fields) - {"purpose"})
            if unknown:
                raise ApiError(422, f"unknown multipart field {unknown[0]!r}; an upload has `file` and `purpose`",
                               [ErrorItem(path=name, message="unknown field", source="body") for name in unknown])
            purpose = upload.fields.get("purpose", DOCUMENT_PURPOSE)
            if purpose != DOCUMENT_PURPOSE:
                raise ApiError(422, f"purpose {purpose!r} is not served here: documents are uploaded with purpose "
                                    f"{DOCUMENT_PURPOSE} (batch inputs in OpenAI's format go to /openai/v1/files)",
                               [ErrorItem(path="purpose", message="not user_data", source="body")])
            if upload.file is None or upload.size == 0:
                raise ApiError(400, "a non-empty multipart part `file` holding the document is required",
                               [ErrorItem(path="file", message="missing or empty", source="body")])
            kind = files.check_document(upload)
            return await anyio.to_thread.run_sync(files.store, upload, purpose, kind)
        finally:
            upload.close()

    @get("/", sync_to_thread=True, summary="The tenant's files, newest first", responses=_errors(422))
    def list_files(self, files: Files,
                   purpose: Annotated[str | None, QueryParameter(max_length=32, description="only this purpose")]
                   = None,
                   after: Annotated[str | None, QueryParameter(max_length=40, description="the last id of the page "
                                                                                        "before")] = None,
                   limit: Annotated[int, QueryParameter(ge=1, le=1000, description="items per page")] = 100
                   ) -> FilePage:
        return files.list(purpose, after, limit)

    @get("/{file_id:str}", sync_to_thread=True, summary="A file's record", responses=_errors(404))
    def get_file(self, file_id: FileId, files: Files) -> FileRead:
        return files.get(file_id)

    @get("/{file_id:str}/content", sync_to_thread=True, media_type="application/octet-stream",
         summary="A file's bytes (streamed)", responses=_errors(404))
    def content(self, file_id: FileId, files: Files) -> Stream:
        return Stream(files.pieces(file_id), media_type="application/octet-stream")

    @delete("/{file_id:str}", sync_to_thread=True, status_code=204,
            summary="Delete a file (a job that has not read it yet fails with file_missing)", responses=_errors(404))
    def delete_file(self, file_id: FileId, files: Files) -> None:
        files.delete(file_id)
