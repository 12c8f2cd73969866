"""Files as the API's bodies carry them: base64 `content` with a media type (POST
/v1/extractions, batch entries), an uploaded file's id (`file_id`), and `data:` URLs (the
OpenAI-compatible content parts). Every problem is an IngestError naming it, with the HTTP
status that fits (413, 415, 422); each surface words and places the error its own way.

Extraction jobs and batches only *check* a file while the request waits (`submitted_file`:
size, media type by its first bytes, that it opens, its page count: structspec.ingest.probe,
milliseconds), and a worker reads it (worker/ingest.py): so do the chat surface's file parts.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from structspec.ingest import TEXT, IngestError, Limits, ingest, probe


@dataclass(frozen=True)
class Submitted:
    """A document as a submission gives it: `text` ready for the model, or a file for a worker
    to read: its bytes (`source`, sent inline) or an uploaded file (`file_id`), with the media
    type its first bytes (or the label given) say and the name given with it."""

    text: str | None = None
    source: bytes | None = None
    file_id: str | None = None
    media_type: str | None = None
    name: str | None = None

    @property
    def to_read(self) -> bool:
        return self.text is None

    def columns(self) -> dict[str, Any]:
        """The job row's columns for this document (db.models.JobRecord)."""
        if not self.to_read:
            return {"document": self.text}
        return {"document": "", "phase": "reading", "source": self.source, "intake": {"files": [self.entry(0)]}}

    def entry(self, offset: int) -> dict[str, Any]:
        """This file in a job's `intake["files"]` (worker/ingest.py reads them): an uploaded file's
        id, or where its bytes sit in the job's `source` (from `offset`)."""
        where = {"file_id": self.file_id} if self.file_id is not None else \
            {"offset": offset, "length": len(self.source)}
        return {**where, **{k: v for k, v in (("media_type", self.media_type), ("name", self.name)) if v is not None}}


@dataclass(frozen=True)
class ChatFiles:
    """A chat request's file parts left for a worker to read: (where, file) each, `where` being
    [message index, content part index] of the text part the file's text will replace."""

    files: tuple[tuple[tuple[int, int], Submitted], ...]

    to_read = True

    def columns(self) -> dict[str, Any]:
        """The job row's columns (db.models.JobRecord): the files inline one after the other in
        `source`, each entry of `intake["files"]` saying where its bytes and its text go."""
        source, entries = bytearray(), []
        for (i, j), file in self.files:
            entries.append({**file.entry(len(source)), "at": [i, j]})
            source += file.source or b""
        return {"document": "", "phase": "reading", "source": bytes(source) or None, "intake": {"files": entries}}


def submitted_file(data: bytes, media_type: str | None, limits: Limits, name: str | None = None) -> Submitted:
    """A file sent inline, checked cheaply (structspec.ingest.probe: size, type, that it opens,
    page count): plain text is taken as text here; anything else is left for a worker to read.
    IngestError names what is wrong."""
    found = probe(data, media_type, name, limits=limits)
    if found.media_type == TEXT or found.media_type.startswith("text/"):
        return Submitted(text=ingest(data, found.media_type, name, limits=limits).text)
    return Submitted(source=data, media_type=found.media_type, name=name)


def decode_base64(content: str) -> bytes:
    """`content`'s bytes; IngestError(422) when it is not base64."""
    try:
        return base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError) as e:
        raise IngestError(422, f"not valid base64: {e}") from None


def data_url(url: str) -> tuple[bytes, str | None]:
    """(bytes, media type or None) of a `data:[<media type>][;base64],<data>` URL; IngestError
    for any other URL (the service fetches nothing) or a malformed one."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0][:20] if ":" in url else "no scheme"
        raise IngestError(422, f"only data: URLs are read (the file inline, base64), not {scheme}: URLs; "
                               "or upload the file (purpose user_data) and give its file_id")
    head, sep, data = url[5:].partition(",")
    if not sep:
        raise IngestError(422, "a data: URL needs a comma before its data")
    params = head.split(";")
    media_type = params[0].strip() or None
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise IngestError(422, "a data: URL of a file must be base64 (data:<media type>;base64,<data>)")
    return decode_base64(data), media_type
