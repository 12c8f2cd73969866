"""structspec.logs: JSON lines carry the structured fields; text lines too; long values are cut."""

from __future__ import annotations

import io
import json
import logging
import uuid

import pytest

from structspec.logs import MAX_CHARS, JsonFormatter, TextFormatter, make_formatter, preview, setup_logging


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


def test_preview_keeps_short_text_and_cuts_long_text_naming_its_length():
    assert preview(None) is None
    assert preview("a  b\nc") == "a b c"
    long = "word " * 100
    cut = preview(long, 20)
    assert cut.startswith("word word") and cut.endswith("(499 chars)") and len(cut) < 40


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
