"""The file store: files' records and their bytes, in pieces (`file_parts`), per tenant.

One store for every file the service holds: documents uploaded to extract from (POST
/v1/files, the OpenAI surface's purpose `user_data`), OpenAI-format batch inputs and the batch
outputs the service writes. The bytes are kept in the database, as the jobs are, so that any
API process and any worker on any machine reads them with nothing else shared; in pieces of
PART_BYTES, so that an upload is written and a read streamed a piece at a time, never a whole
file in memory. Another tenant's id reads as an unknown one.
"""

from __future__ import annotations

import uuid
from typing import BinaryIO, Iterator, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from structspec.db.columns import database_now
from structspec.db.models import FilePartRecord, FileRecord

PART_BYTES = 1 << 20  # 1 MiB: a 50 MB upload is 50 rows
DOCUMENT_PURPOSE = "user_data"  # an uploaded document to extract from (OpenAI's purpose name for it)


def new_id(prefix: str) -> str:
    """OpenAI-looking ids: `file-<hex>`, `batch_<hex>`."""
    return prefix + uuid.uuid4().hex


class FileRepository:
    def __init__(self, session: Session, tenant: str):
        self.session, self.tenant = session, tenant

    def add(self, *, purpose: str, filename: str, content: bytes, media_type: str | None = None) -> FileRecord:
        """Store `content` (bytes the service holds anyway: a batch's output, a test's file)."""
        record = self._record(purpose, filename, media_type)
        for seq, start in enumerate(range(0, len(content), PART_BYTES)):
            self._part(record.id, seq, content[start:start + PART_BYTES])
        record.bytes = len(content)
        self.session.flush()
        return record

    def add_from(self, *, purpose: str, filename: str, stream: BinaryIO, media_type: str | None = None) -> FileRecord:
        """Store what `stream` holds (an upload spooled to disk), one piece at a time."""
        record = self._record(purpose, filename, media_type)
        size = seq = 0
        while piece := stream.read(PART_BYTES):
            self._part(record.id, seq, piece)
            # a Core insert: the session keeps no object per piece, so one piece is in memory at a time
            size += len(piece)
            seq += 1
        record.bytes = size
        self.session.flush()
        return record

    def get(self, file_id: str) -> FileRecord | None:
        record = self.session.get(FileRecord, file_id)
        return record if record is not None and record.tenant == self.tenant else None

    def content(self, file_id: str) -> bytes:
        """The whole file (the caller checked that it is this tenant's)."""
        return b"".join(self.pieces(file_id))

    def pieces(self, file_id: str) -> Iterator[bytes]:
        """The file's bytes in order, one piece per query."""
        seq = 0
        while True:
            data = self.session.scalar(sa.select(FilePartRecord.data).where(
                FilePartRecord.file_id == file_id, FilePartRecord.seq == seq))
            if data is None:
                return
            yield data
            seq += 1

    def delete(self, file_id: str) -> bool:
        """Delete the file and its pieces (cascade)."""
        return self.session.execute(sa.delete(FileRecord).where(
            FileRecord.id == file_id, FileRecord.tenant == self.tenant)).rowcount == 1

    def page(self, purpose: str | None, after: str | None, limit: int) -> Sequence[FileRecord]:
        """Newest first; `after`: the last id of the previous page."""
        q = sa.select(FileRecord).where(FileRecord.tenant == self.tenant)
        if purpose is not None:
            q = q.where(FileRecord.purpose == purpose)
        return newest_first(self.session, q, FileRecord, after, self.get, limit)

    def _record(self, purpose: str, filename: str, media_type: str | None) -> FileRecord:
        record = FileRecord(id=new_id("file-"), tenant=self.tenant, purpose=purpose, filename=filename[:255],
                            bytes=0, media_type=media_type[:200] if media_type else None,
                            created_at=database_now(self.session))
        self.session.add(record)
        self.session.flush()
        return record

    def _part(self, file_id: str, seq: int, data: bytes) -> None:
        self.session.execute(sa.insert(FilePartRecord).values(file_id=file_id, seq=seq, data=data))


def newest_first(session: Session, q, model, after: str | None, get, limit: int):
    """A page of `q` by (created_at, id) descending, after the row with id `after` (read with
    `get`; an unknown id: an empty page)."""
    if after is not None:
        cursor = get(after)
        if cursor is None:
            return []
        q = q.where(sa.or_(model.created_at < cursor.created_at,
                           sa.and_(model.created_at == cursor.created_at, model.id < cursor.id)))
    return session.scalars(q.order_by(model.created_at.desc(), model.id.desc()).limit(limit)).all()


def delete_expired_files(session: Session, cutoff, limit: int) -> int:
    """Delete up to `limit` files (uploads, batch inputs and outputs) created before `cutoff`,
    with their pieces; returns how many."""
    ids = list(session.scalars(sa.select(FileRecord.id).where(FileRecord.created_at < cutoff).limit(limit)))
    if ids:
        session.execute(sa.delete(FileRecord).where(FileRecord.id.in_(ids)))
    return len(ids)
