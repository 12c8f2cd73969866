"""A stand-in `tesseract` for the tests of OCR's time and failure paths: a shell script put
first on PATH, which answers `--list-langs` with the English model and runs `body` for a page
(its stdin is the page's PPM image; its stdout Tesseract's TSV)."""

from __future__ import annotations

import os
import stat

import pytest

from structspec.ingest import ocr


@pytest.fixture
def fake_tesseract(tmp_path, monkeypatch):
    """fake_tesseract(body) -> the directory holding the script, already first on PATH here."""
    def make(body: str):
        script = tmp_path / "tesseract"
        script.write_text("#!/bin/sh\n"
                          'if [ "$1" = "--list-langs" ]; then printf "List of available languages (1):\\neng\\n"; '
                          "exit 0; fi\n" + body + "\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
        ocr.engine.cache_clear()
        return tmp_path

    yield make
    ocr.engine.cache_clear()
