"""Multipart uploads read as they arrive: the `file` part goes to a temporary file that stays in
memory only up to SPOOL_BYTES (then it is on disk), the other parts (`purpose`) are short
fields. Nothing holds the whole body: an upload of max_file_bytes costs SPOOL_BYTES of memory.
Used by POST /v1/files and POST /openai/v1/files, which store the result in the file store
(structspec/db/files.py) a piece at a time.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import IO

import multipart
from litestar import Request

from structspec.api.errors import ApiError, ErrorItem, PayloadTooLargeError

SPOOL_BYTES = 1 << 20
FIELD_BYTES = 1024  # a form field other than the file (purpose)
MAX_PARTS = 8


@dataclass
class Upload:
    """The `file` part (spooled; at position 0) with its name, type and size, and the other fields."""

    file: IO[bytes] | None = None
    filename: str | None = None
    content_type: str | None = None
    size: int = 0
    fields: dict[str, str] = field(default_factory=dict)
    head: bytes = b""  # the file's first bytes (its type by magic bytes)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _bad(message: str, path: str) -> ApiError:
    return ApiError(400, message, [ErrorItem(path=path, message=message, source="body")])


async def read_upload(request: Request, max_file_bytes: int) -> Upload:
    """The multipart body of `request`, its `file` part spooled; 413 naming max_file_bytes as
    soon as the file passes it (the rest is not read), 400 for a body that is not multipart."""
    content_type, options = multipart.parse_options_header(request.headers.get("content-type", ""))
    boundary = options.get("boundary")
    if content_type != "multipart/form-data" or not boundary:
        raise ApiError(415, "send the file as multipart/form-data (a `file` part, and `purpose`)",
                       [ErrorItem(path="Content-Type", message="not multipart/form-data with a boundary",
                                  source="header")])
    upload = Upload()
    parser = multipart.PushMultipartParser(boundary, max_segment_count=MAX_PARTS)
    segment, value = None, bytearray()
    try:
        async for chunk in request.stream():
            for event in parser.parse(chunk):
                if isinstance(event, multipart.MultipartSegment):
                    segment, value = event, bytearray()
                    if segment.name == "file" and upload.file is None:
                        upload.file = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)
                        upload.filename, upload.content_type = segment.filename, segment.content_type
                elif event is None:  # the end of a part
                    if segment is not None and segment.name != "file":
                        upload.fields[segment.name] = value.decode("utf-8", "replace")
                    segment = None
                elif segment is not None and segment.name == "file":
                    upload.size += len(event)
                    if upload.size > max_file_bytes:
                        raise PayloadTooLargeError(
                            f"the file is larger than the limit of {max_file_bytes} bytes (max_file_bytes)",
                            [ErrorItem(path="file", message=f"over {max_file_bytes} bytes", source="body")])
                    if len(upload.head) < 16:
                        upload.head += event[:16 - len(upload.head)]
                    upload.file.write(event)
                elif segment is not None:
                    value += event
                    if len(value) > FIELD_BYTES:
                        raise _bad(f"the multipart field {segment.name!r} is longer than {FIELD_BYTES} bytes",
                                   segment.name)
        parser.close()
    except multipart.MultipartError as e:
        upload.close()
        raise _bad(f"the multipart body cannot be read: {e}", "") from None
    except BaseException:
        upload.close()
        raise
    if upload.file is not None:
        upload.file.seek(0)
    return upload
