"""Logging for the service processes (`structspec serve`, `structspec worker`).

Two formats, picked by `STRUCTSPEC_LOG_FORMAT`:

  text  `2026-11-22 18:20:01,123 INFO structspec.worker: job finished job_id=... status=succeeded`
  json  one JSON object per line: {"ts", "level", "logger", "message", ...fields}

Fields are what a call site passes with `extra=` (job_id, schema_id, batch_id, strategy,
status, duration_s, ...); both formats print them. Documents and model outputs are never
logged: call sites log lengths and ids, and any message that may quote a document or a result
(an exception's, a job's error) goes through `preview()`, which keeps its structural prefix
and gives the rest only as a length and a digest. A logged exception's traceback (`exc`, and
`log.exception`) lists its frames, and each exception's message through `preview()` too. As a
backstop every field and message is cut to `MAX_CHARS`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import json
import logging
import re
import secrets
import sys
import traceback
import uuid
from typing import Any

FORMATS = ("text", "json")
MAX_CHARS = 2000  # backstop: no single message or field value is longer than this
PREVIEW_CHARS = 120

# Attributes every LogRecord has; anything else on a record came from `extra=`.
# uvicorn's color_message repeats the message with terminal colours.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName",
                                                                          "color_message"}


# Where a message's structural prefix ends: the first quote (Python's repr and most libraries
# quote the values they name), digit (a number may be a value), bracket or brace (a list, an
# object), `<`, `=`, or `: ` (what follows a colon is usually the detail, often a value).
_CONTENT_START = re.compile(r"""['"`\u2018\u2019\u201c\u201d\u00ab\u00bb0-9\[\]{}<=]|: """)
# Exceptions about reaching a service, whose messages name hosts, ports and states, never a
# document: kept whole (cut to the limit), since an operator needs them.
_CONNECTIVITY = {"sqlalchemy.exc.OperationalError", "sqlalchemy.exc.InterfaceError",
                 "sqlalchemy.exc.DisconnectionError", "sqlalchemy.exc.TimeoutError",
                 "kombu.exceptions.OperationalError", "psycopg.OperationalError",
                 "redis.exceptions.ConnectionError", "redis.exceptions.TimeoutError"}
# Digests are keyed per process: equal messages in one process's log have equal digests, and a
# short value (a number, a name) cannot be found by hashing guesses.
_DIGEST_KEY = secrets.token_bytes(16)


def preview(text: Any, limit: int = PREVIEW_CHARS) -> str | None:
    """What a log may say of a message that may quote a document or a result: its structural
    prefix (up to the first quote, digit, bracket, `=` or `: `, at most `limit` characters),
    then its length and a digest, e.g. `invalid... (48 chars, #1f3a9c0d)`; the message whole when
    it holds none of those. An exception about reaching a service (OSError, the database's and
    the broker's connection errors) keeps its message, cut to `limit`."""
    if text is None:
        return None
    if isinstance(text, BaseException) and _is_connectivity(text):
        return clip(text, limit)
    text = " ".join(str(text).split())
    found = _CONTENT_START.search(text)
    if found is None and len(text) <= limit:
        return text
    prefix = text[:found.start() if found else limit][:limit].rstrip()
    digest = hmac.new(_DIGEST_KEY, text.encode("utf-8", "replace"), hashlib.sha256).hexdigest()[:8]
    return f"{prefix}... ({len(text)} chars, #{digest})"


def clip(text: Any, limit: int = PREVIEW_CHARS) -> str | None:
    """`text` cut to `limit` characters (with the full length noted): for text that cannot hold a
    document or a result (a service's answer, an address refused)."""
    if text is None:
        return None
    text = " ".join(str(text).split())
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def _is_connectivity(exc: BaseException) -> bool:
    return isinstance(exc, OSError) or any(f"{c.__module__}.{c.__qualname__}" in _CONNECTIVITY
                                           for c in type(exc).__mro__)


def safe_traceback(exc_info) -> str:
    """A traceback like logging's, each exception's message through `preview()`: frames (file,
    line, code) are the program's, messages may quote what it was working on."""
    _, exc, _ = exc_info
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ if exc.__cause__ is not None else (None if exc.__suppress_context__ else exc.__context__)
    parts, earlier = [], None
    for e in reversed(chain):  # the first cause first, as Python prints them
        if earlier is not None:
            parts.append("\nThe above exception was the direct cause of the following exception:\n\n"
                         if e.__cause__ is earlier else
                         "\nDuring handling of the above exception, another exception occurred:\n\n")
        if e.__traceback__ is not None:
            parts.append("Traceback (most recent call last):\n" + "".join(traceback.format_tb(e.__traceback__)))
        name = type(e).__qualname__ if type(e).__module__ == "builtins" else f"{type(e).__module__}.{type(e).__qualname__}"
        message = preview(e, 200)
        parts.append(f"{name}: {message}\n" if message else f"{name}\n")
        earlier = e
    return "".join(parts).rstrip("\n")


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a record carries (its `extra=`), in the order they were set."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value[:50]]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in list(value.items())[:50]}
    text = str(value) if isinstance(value, (str, uuid.UUID)) else repr(value)
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS] + "...(cut)"


def _cut(text: str) -> str:
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS] + "...(cut)"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ISO 8601), level, logger, message, the record's
    fields, and `exc` (the formatted traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": _cut(record.getMessage()),
        }
        for key, value in fields_of(record).items():
            if key not in out:
                out[key] = _plain(value)
        if record.exc_info:
            out["exc"] = _cut(safe_traceback(record.exc_info))
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message key=value ...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = _cut(record.getMessage())
        line = self.formatMessage(_with_time(self, record))
        extra = " ".join(f"{k}={_text_value(v)}" for k, v in fields_of(record).items())
        if extra:
            line = f"{line} {extra}"
        if record.exc_info:
            line = f"{line}\n{_cut(safe_traceback(record.exc_info))}"
        return line


def _with_time(formatter: logging.Formatter, record: logging.LogRecord) -> logging.LogRecord:
    record.asctime = formatter.formatTime(record)
    return record


def _text_value(value: Any) -> str:
    value = _plain(value)
    if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
        text = ",".join(str(v) for v in value)
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\n')) else text


def make_formatter(fmt: str) -> logging.Formatter:
    if fmt not in FORMATS:
        raise ValueError(f"STRUCTSPEC_LOG_FORMAT={fmt!r}: expected one of {', '.join(FORMATS)}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def setup_logging(fmt: str = "text", level: int | str = logging.INFO, stream=None) -> logging.Handler:
    """Send every logger through one stderr handler with `fmt`'s formatter (replacing the root
    logger's handlers), at `level`. Returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(make_formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # warnings (e.g. Celery's as-root warning) become log lines too
    return handler
