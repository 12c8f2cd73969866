"""Checks every request gets before its handler runs (the app's `before_request` hook): the body's
media type (415), and text no field may hold, in the URL and in JSON bodies (400 naming where).

- **U+0000 (NUL).** PostgreSQL cannot store it in text, so a NUL in a name, a cursor, an id, a
  URL or a document raised a database error (a 500) there while SQLite stored it. It is refused
  on every backend alike: in the path (`%00`), in a query parameter (naming it) and anywhere in
  a JSON or NDJSON body (naming the JSON pointer, and the line for NDJSON).
- **A body that is not JSON** (`text/plain`, a form) on a route that takes JSON: 415 naming the
  types it takes (NDJSON too for batches, multipart for file uploads). No Content-Type at all
  is read as JSON.
- **A lone UTF-16 surrogate escape** (`\\ud800` with no low half after it) is not text; the JSON
  decoder called it "Input data was truncated". It is refused naming the escape and its byte.

Multipart bodies (the OpenAI Files upload) are checked by their route, on the file's content.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl

import msgspec
from litestar import Request

from structspec.api.errors import ApiError, ErrorItem

# a backslash pair (skipped, so `\\u0000` is text, not an escape) or a \u escape
_ESCAPE = re.compile(rb"\\\\|\\u([0-9a-fA-F]{4})")
_JSON_TYPES = ("application/json", "application/x-ndjson", "application/jsonl", "application/ndjson")
NEWLINE = b"\n"
NUL_REASON = "U+0000 (NUL) cannot be stored; no text may hold it"


async def check_request(request: Request) -> None:
    """Raise ApiError (400) for NUL in the path, the query or a JSON body, or a lone surrogate."""
    if "\x00" in request.scope.get("path", ""):
        raise _bad("the URL path holds %00 (U+0000)", "", "path")
    for name, value in parse_qsl(request.scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True):
        if "\x00" in name or "\x00" in value:
            raise _bad(f"query parameter {name.replace(chr(0), '%00')!r} holds %00 (U+0000)", name, "query")
    if request.method not in ("POST", "PUT", "PATCH"):
        return
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    accepted = _accepted_types(request.scope.get("path", ""))
    if content_type and content_type not in accepted:
        raise ApiError(415, f"content type {content_type!r} is not accepted here; send {' or '.join(accepted)}",
                       [ErrorItem(path="Content-Type", message=f"not one of {', '.join(accepted)}", source="header")])
    if content_type in _JSON_TYPES:
        check_body(await request.body(), ndjson=content_type != "application/json")


def _accepted_types(path: str) -> tuple[str, ...]:
    """The body media types of a route: JSON, and NDJSON for batches, multipart for file uploads."""
    if path.rstrip("/") == "/v1/batches":
        return _JSON_TYPES
    if path.rstrip("/") in ("/openai/v1/files", "/v1/files"):
        return ("multipart/form-data",)
    return ("application/json",)


def check_body(data: bytes, ndjson: bool = False) -> None:
    """Raise ApiError (400) for a NUL or a lone surrogate escape in JSON text `data`."""
    if b"\\u" not in data and b"\x00" not in data:
        return
    nul = data.find(b"\x00")
    if nul >= 0:
        raise _bad(f"the request body holds a NUL byte at byte {nul}", "", "body")
    matches = list(_ESCAPE.finditer(data))
    for i, m in enumerate(matches):
        if m.group(1) is None:
            continue
        code = int(m.group(1), 16)
        if code == 0:
            raise _bad(f"the request body holds \\u0000 (U+0000) {_where(data, m.start(), ndjson)}",
                       _pointer(data, m.start(), ndjson), "body")
        high = 0xD800 <= code <= 0xDBFF
        low = 0xDC00 <= code <= 0xDFFF
        if high:
            after = matches[i + 1] if i + 1 < len(matches) else None
            if after is not None and after.start() == m.end() and after.group(1) is not None \
                    and 0xDC00 <= int(after.group(1), 16) <= 0xDFFF:
                continue
        elif low:
            before = matches[i - 1] if i else None
            if before is not None and before.end() == m.start() and before.group(1) is not None \
                    and 0xD800 <= int(before.group(1), 16) <= 0xDBFF:
                continue
        if high or low:
            escape = m.group(0).decode()
            detail = (f"request body is not valid JSON: a lone UTF-16 surrogate {escape} at byte {m.start()} "
                      "(a surrogate escape must be a high-low pair, such as \\ud83d\\ude00)")
            raise ApiError(400, detail, [ErrorItem(path=_pointer(data, m.start(), ndjson), message=detail,
                                                   source="body")])


def _where(data: bytes, offset: int, ndjson: bool) -> str:
    pointer = _pointer(data, offset, ndjson)
    line = f"line {data.count(NEWLINE, 0, offset) + 1}, " if ndjson else ""
    return f"at {line}{pointer or '/'}" if pointer is not None else f"at byte {offset}"


def _pointer(data: bytes, offset: int, ndjson: bool) -> str | None:
    """The JSON pointer of the first string (key or value) holding U+0000 in the JSON text around
    `offset` (its line, for NDJSON); None when it does not decode."""
    if ndjson:
        start = data.rfind(b"\n", 0, offset) + 1
        end = data.find(b"\n", offset)
        data = data[start:end if end >= 0 else len(data)]
    try:
        value = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return None
    return _find_nul(value, "")


def _find_nul(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            here = path + "/" + str(key).replace("~", "~0").replace("/", "~1").replace("\x00", "\\u0000")
            if "\x00" in str(key):
                return here
            found = _find_nul(item, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_nul(item, f"{path}/{i}")
            if found is not None:
                return found
    return None


def _bad(detail: str, path: str | None, source: str) -> ApiError:
    return ApiError(400, detail, [ErrorItem(path=path or "", message=NUL_REASON, source=source)])
