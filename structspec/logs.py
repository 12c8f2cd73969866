"""Logging for the service processes (`structspec serve`, `structspec worker`).

Two formats, picked by `STRUCTSPEC_LOG_FORMAT`:

  text  `2026-11-22 18:20:01,123 INFO structspec.worker: job finished job_id=... status=succeeded`
  json  one JSON object per line: {"ts", "level", "logger", "message", ...fields}

Fields are what a call site passes with `extra=` (job_id, schema_id, batch_id, strategy,
status, duration_s, ...); both formats print them. Documents and model outputs are never
logged: call sites log lengths and ids, and anything derived from a document (an error
message may quote the output) goes through `preview()` first. As a backstop every field and
message is cut to `MAX_CHARS`.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
import uuid
from typing import Any

FORMATS = ("text", "json")
MAX_CHARS = 2000  # backstop: no single message or field value is longer than this
PREVIEW_CHARS = 120

# Attributes every LogRecord has; anything else on a record came from `extra=`.
# uvicorn's color_message repeats the message with terminal colours.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName",
                                                                          "color_message"}


def preview(text: Any, limit: int = PREVIEW_CHARS) -> str | None:
    """`text` cut to `limit` characters (with the full length noted), for document-derived values."""
    if text is None:
        return None
    text = " ".join(str(text).split())
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


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
            out["exc"] = _cut(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc"] = _cut(record.exc_text)
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
            line = f"{line}\n{_cut(self.formatException(record.exc_info))}"
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
