"""Uploaded files (POST /v1/files and the OpenAI surface's /openai/v1/files): check, store,
list, read, delete; one file store (structspec/db/files.py) for both surfaces."""

from __future__ import annotations

import logging
from typing import Iterator

from sqlalchemy.orm import Session, sessionmaker

from structspec.api.errors import ApiError, ErrorItem, NotFoundError
from structspec.api.structs import FilePage, FileRead
from structspec.api.uploads import Upload
from structspec.config import Settings
from structspec.db.files import FileRepository
from structspec.db.models import FileRecord

log = logging.getLogger(__name__)


def file_read(record: FileRecord) -> FileRead:
    return FileRead(id=record.id, filename=record.filename, bytes=record.bytes, purpose=record.purpose,
                    media_type=record.media_type, created_at=record.created_at)


class FileService:
    """Files of one tenant: another tenant's ids are unknown ids (404)."""

    def __init__(self, session_factory: sessionmaker[Session], settings: Settings, tenant: str):
        self.session_factory, self.settings, self.tenant = session_factory, settings, tenant

    def check_document(self, upload: Upload) -> str:
        """The media type of an uploaded document, from its first bytes (else its label or name);
        415 for one structspec cannot read. The rest (that it opens, its pages, its pixels) is
        checked by the worker that reads it, under the decoders' budgets."""
        from structspec.ingest import MEDIA_TYPES, detect

        kind = detect(upload.head, _label(upload.content_type), upload.filename)
        if kind not in MEDIA_TYPES and not kind.startswith("text/"):
            raise ApiError(415, f"unsupported media type {kind}; a document is one of {', '.join(MEDIA_TYPES)}",
                           [ErrorItem(path="file", message=f"media type {kind}", source="body")])
        return kind

    def store(self, upload: Upload, purpose: str, media_type: str | None) -> FileRead:
        """Store the spooled upload a piece at a time."""
        with self.session_factory.begin() as session:
            record = FileRepository(session, self.tenant).add_from(
                purpose=purpose, filename=upload.filename or "upload", stream=upload.file, media_type=media_type)
            answer = file_read(record)
        log.info("file uploaded", extra={"file_id": answer.id, "tenant": self.tenant, "purpose": purpose,
                                         "bytes": answer.bytes, "media_type": media_type})
        return answer

    def get(self, file_id: str) -> FileRead:
        with self.session_factory() as session:
            return file_read(self._file(session, file_id))

    def list(self, purpose: str | None, after: str | None, limit: int) -> FilePage:
        with self.session_factory() as session:
            page = FileRepository(session, self.tenant).page(purpose, after, limit + 1)
            return FilePage(items=[file_read(f) for f in page[:limit]], has_more=len(page) > limit)

    def pieces(self, file_id: str) -> Iterator[bytes]:
        """The file's bytes a piece at a time (a 404 before the first one for an unknown id)."""
        with self.session_factory() as session:
            self._file(session, file_id)

        def stream() -> Iterator[bytes]:
            with self.session_factory() as session:
                yield from FileRepository(session, self.tenant).pieces(file_id)

        return stream()

    def delete(self, file_id: str) -> None:
        with self.session_factory.begin() as session:
            if not FileRepository(session, self.tenant).delete(file_id):
                raise NotFoundError(f"no file with id {file_id}")
        log.info("file deleted", extra={"file_id": file_id, "tenant": self.tenant})

    def _file(self, session: Session, file_id: str) -> FileRecord:
        record = FileRepository(session, self.tenant).get(file_id)
        if record is None:
            raise NotFoundError(f"no file with id {file_id}")
        return record


def _label(content_type: str | None) -> str | None:
    """A part's Content-Type as a hint, unless it is the generic one (which says nothing)."""
    if not content_type or content_type.split(";")[0].strip().lower() == "application/octet-stream":
        return None
    return content_type
