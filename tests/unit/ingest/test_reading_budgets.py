"""Limits and error codes: the defaults are the settings', and every code has one definition."""

from __future__ import annotations

import pickle
import re
from dataclasses import fields

import pytest

from structspec.config import Settings
from structspec.ingest import FILE_ERRORS, IngestError, Limits
from structspec.ingest.limits import MIB, SETTINGS, Budget


def test_the_default_limits_are_the_settings_defaults_and_follow_the_settings():
    assert Limits() == Limits.from_settings(Settings())
    custom = Limits.from_settings(Settings(max_file_bytes=7, ingest_max_pages=3, ingest_max_ocr_pages=2,
                                           ingest_max_page_pixels=1000, ingest_max_document_pixels=5000,
                                           ingest_ocr_page_timeout_s=4, ingest_timeout_s=9,
                                           ingest_max_decompressed_mb=2, ingest_max_memory_mb=300))
    assert custom == Limits(max_bytes=7, max_pages=3, max_ocr_pages=2, max_page_pixels=1000, max_document_pixels=5000,
                            ocr_page_timeout_s=4, timeout_s=9, max_decompressed_bytes=2 * MIB,
                            max_memory_bytes=300 * MIB)
    # every field names a setting that exists
    assert set(SETTINGS) == {f.name for f in fields(Limits)}
    assert set(SETTINGS.values()) <= {f.name for f in fields(Settings)}


@pytest.mark.parametrize("field, value", [("max_pages", 0), ("max_page_pixels", -1), ("timeout_s", 0),
                                          ("max_memory_bytes", "1G")])
def test_a_limit_that_cannot_be_one_is_refused_naming_its_setting(field, value):
    with pytest.raises(ValueError, match=rf"Limits.{field} \({SETTINGS[field]}\) must be a number over 0"):
        Limits(**{field: value})
    assert Limits(max_ocr_pages=0).max_ocr_pages == 0  # no OCR at all: text layers only


def test_an_error_code_defaults_to_its_status_and_is_one_of_the_defined_codes():
    assert [IngestError(status, "x").code for status in (413, 415, 422)] == [
        "file_too_large", "unsupported_media_type", "file_unreadable"]
    assert IngestError(422, "x", code="file_encrypted").code == "file_encrypted"
    with pytest.raises(ValueError, match="unknown IngestError code 'nope'"):
        IngestError(422, "x", code="nope")
    # 404 only for an uploaded file gone before a worker read it (worker/ingest.py)
    assert all(status in (413, 415, 422) and meaning for code, (status, meaning) in FILE_ERRORS.items()
               if code != "file_missing")
    assert FILE_ERRORS["file_missing"][0] == 404
    assert {"file_encrypted", "no_text_found", "ocr_unavailable", "read_timeout", "read_memory",
            "read_crashed"} <= set(FILE_ERRORS)


def test_an_ingest_error_keeps_its_status_and_code_through_pickle():
    back = pickle.loads(pickle.dumps(IngestError(413, "too big", code="read_memory")))
    assert (type(back), back.status, back.code, str(back)) == (IngestError, 413, "read_memory", "too big")


def test_the_ocr_timeout_is_the_pages_or_what_is_left_of_the_documents():
    budget = Budget(Limits(ocr_page_timeout_s=60, timeout_s=240))
    assert budget.ocr_timeout(1) == (60, "ingest_ocr_page_timeout_s")
    budget.start -= 200  # 200 s spent: 40 left
    seconds, setting = budget.ocr_timeout(2)
    assert 39 < seconds <= 40 and setting == "ingest_timeout_s"
    budget.start -= 50
    with pytest.raises(IngestError, match=r"longer than its limit of 240 s \(ingest_timeout_s\).*before OCR of page 3"
                       ) as e:
        budget.ocr_timeout(3)
    assert (e.value.status, e.value.code) == (422, "read_timeout")


def test_the_docs_table_of_file_error_codes_is_file_errors():
    from pathlib import Path

    api = (Path(__file__).resolve().parents[3] / "docs" / "api.md").read_text()
    rows = [line.strip() for line in api.splitlines() if re.fullmatch(r"\| `\w+` \| \d{3} \| [^|]+ \|", line.strip())]
    assert rows == [f"| `{code}` | {status} | {meaning} |" for code, (status, meaning) in FILE_ERRORS.items()]
