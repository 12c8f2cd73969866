"""structspec.logs: JSON lines carry the structured fields; text lines too; long values are cut."""

from __future__ import annotations

import io
import json
import logging
import uuid

import pytest

from structspec.logs import MAX_CHARS, JsonFormatter, TextFormatter, clip, make_formatter, preview, setup_logging


def record(msg="job finished", *args, exc_info=None, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("structspec.worker", logging.INFO, __file__, 1, msg, args, exc_info)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_json_line_has_time_level_logger_message_and_the_extra_fields():
    job, schema = uuid.uuid4(), uuid.uuid4()
    line = JsonFormatter().format(record("job %s", "finished", job_id=str(job), schema_id=schema,
                                         status="succeeded", duration_s=1.25, draft_len=None))
    assert "\n" not in line
    out = json.loads(line)
    assert out["level"] == "INFO" and out["logger"] == "structspec.worker" and out["message"] == "job finished"
    assert out["ts"].endswith("+00:00") and "T" in out["ts"]
    assert (out["job_id"], out["schema_id"]) == (str(job), str(schema))  # a UUID is written as its string
    assert (out["status"], out["duration_s"], out["draft_len"]) == ("succeeded", 1.25, None)
    assert not {"args", "msg", "levelno", "pathname"} & set(out)  # LogRecord internals stay out
    out = json.loads(JsonFormatter().format(record("Uvicorn running", color_message="\x1b[1mUvicorn running")))
    assert "color_message" not in out


def test_json_line_carries_the_traceback_and_cuts_long_values():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        rec = record("crashed", exc_info=sys.exc_info(), error="x" * (MAX_CHARS * 3))
    out = json.loads(JsonFormatter().format(rec))
    assert "RuntimeError: boom" in out["exc"]
    assert len(out["error"]) < MAX_CHARS + 20 and out["error"].endswith("...(cut)")


def test_text_line_appends_the_fields_as_key_value_pairs():
    line = TextFormatter().format(record(job_id="j1", schema_id="s1", error="truncated: max tokens"))
    assert "INFO structspec.worker: job finished job_id=j1 schema_id=s1" in line
    assert 'error="truncated: max tokens"' in line


MARKER = "Zanzibar-Widgets"  # stands for a document's or a result's text


def test_preview_keeps_plain_short_text_and_cuts_long_text_naming_its_length():
    assert preview(None) is None
    assert preview("a  b\nc") == "a b c"
    assert preview("database is locked") == "database is locked"
    long = "word " * 100
    cut = preview(long, 20)
    assert cut.startswith("word word") and "(499 chars, #" in cut and len(cut) < 60


@pytest.mark.parametrize("message, prefix", [
    (f"invalid: output violates the schema: '{MARKER}' is not of type 'number'", "invalid"),
    (f"output is not JSON: Expecting value near {MARKER}", "output is not JSON"),
    (f"grammar refused the verified token 4012: lexer error at \"{MARKER}\"", "grammar refused the verified token"),
    (f"'{MARKER}'", ""),
    (f"[{{'vendor': '{MARKER}'}}]", ""),
    (f"7 {MARKER}", ""),
    (f"total={MARKER}", "total"),
])
def test_preview_keeps_the_structural_prefix_and_gives_the_rest_as_length_and_digest(message, prefix):
    """A message that may quote a document or a result is logged up to the first quote, digit,
    bracket, `=` or `: `; the rest only as its length and a digest."""
    out = preview(message)
    assert MARKER not in out
    text = " ".join(message.split())
    assert out.startswith(prefix) and out.endswith(f"({len(text)} chars, #{out[-9:-1]})")
    assert preview(message) == out and preview(message + "x") != out  # the digest tells messages apart


def test_preview_keeps_a_connection_errors_message_and_clip_keeps_any_text():
    refused = ConnectionRefusedError(111, "Connection refused")
    assert preview(refused) == "[Errno 111] Connection refused"
    assert clip(f"HTTP 500: '{MARKER}'") == f"HTTP 500: '{MARKER}'"


def test_a_logged_exception_shows_its_frames_and_not_the_content_its_message_quotes():
    def extract():
        raise ValueError(f"output violates the schema: '{MARKER}' is not one of ['a', 'b']")

    try:
        try:
            extract()
        except ValueError as e:
            raise RuntimeError(f"job failed: {e}") from e
    except RuntimeError:
        import sys

        rec = record("extraction crashed", exc_info=sys.exc_info())
    for line in (json.loads(JsonFormatter().format(rec))["exc"], TextFormatter().format(rec)):
        assert MARKER not in line
        assert "Traceback (most recent call last)" in line and "in extract" in line
        assert "ValueError: output violates the schema... (" in line
        assert "RuntimeError: job failed... (" in line and "direct cause" in line


def test_unknown_format_is_refused_and_setup_routes_the_root_logger_through_one_handler():
    with pytest.raises(ValueError, match="STRUCTSPEC_LOG_FORMAT='xml'"):
        make_formatter("xml")
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    try:
        stream = io.StringIO()
        setup_logging("json", logging.INFO, stream=stream)
        logging.getLogger("structspec.api").info("job submitted", extra={"job_id": "j", "schema_id": "s"})
        logging.getLogger("structspec.api").debug("not at INFO")
        [line] = stream.getvalue().splitlines()
        assert json.loads(line)["job_id"] == "j" and root.handlers[-1].stream is stream
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
