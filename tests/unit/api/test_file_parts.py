"""Files as the API's bodies carry them (structspec/api/services/content.py) and the OpenAI
file content parts that become message text (structspec/api/services/openai.py inline_files):
the real invoice PDF of tests/fixtures/invoices (MIT, see LICENSE.md there)."""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace

import pytest

from structspec.api.errors import ApiError
from structspec.api.services import content
from structspec.api.services.content import OcrBudget, data_url, decode_base64
from structspec.api.services.openai import inline_files
from structspec.ingest import IngestError, Limits, ingest

PDF = (Path(__file__).resolve().parents[2] / "fixtures" / "invoices" / "AzureInterior.pdf").read_bytes()
PDF_URL = "data:application/pdf;base64," + base64.b64encode(PDF).decode()


def no_files(file_id: str):
    return None


def test_data_urls_and_base64_decode_or_name_the_problem():
    assert data_url(PDF_URL) == (PDF, "application/pdf")
    assert data_url("data:;base64," + base64.b64encode(b"hi").decode()) == (b"hi", None)
    for url, message in [("https://example.com/a.pdf", "not https: URLs"),
                         ("data:application/pdf;base64", "needs a comma"),
                         ("data:text/plain,hello", "must be base64"),
                         ("data:application/pdf;base64,%%%", "not valid base64")]:
        with pytest.raises(IngestError, match=message) as e:
            data_url(url)
        assert e.value.status == 422
    with pytest.raises(IngestError, match="not valid base64"):
        decode_base64("not base64!")


def test_a_file_part_becomes_the_pdfs_text_set_apart_from_the_text_beside_it():
    text = ingest(PDF).text
    messages = [{"role": "system", "content": "Extract."},
                {"role": "user", "content": [{"type": "text", "text": "The invoice:"},
                                             {"type": "file", "file": {"file_data": PDF_URL, "filename": "a.pdf"}},
                                             {"type": "text", "text": "Thanks."}]}]
    out = inline_files(messages, no_files, OcrBudget())
    assert out[0] is messages[0]  # messages without a file part are left as they are
    assert "".join(p["text"] for p in out[1]["content"]) == f"The invoice:\n\n{text}\n\nThanks."
    alone = inline_files([{"role": "user", "content": [{"type": "file", "file": {"file_data": PDF_URL}}]}],
                         no_files, OcrBudget())
    assert "".join(p["text"] for p in alone[0]["content"]) == text
    two = inline_files([{"role": "user", "content": [{"type": "file", "file": {"file_data": PDF_URL}}] * 2}],
                       no_files, OcrBudget())
    assert "".join(p["text"] for p in two[0]["content"]) == f"{text}\n\n{text}"  # one blank line between


def test_an_uploaded_user_data_file_is_read_by_its_id_and_other_purposes_are_refused():
    records = {"file-1": SimpleNamespace(id="file-1", purpose="user_data", content=PDF, filename="inv.pdf"),
               "file-2": SimpleNamespace(id="file-2", purpose="batch", content=b"{}\n", filename="in.jsonl")}
    part = {"type": "file", "file": {"file_id": "file-1"}}
    out = inline_files([{"role": "user", "content": [part]}], records.get, OcrBudget())
    assert out[0]["content"][0]["text"] == ingest(PDF).text
    for file, status, message in [({"file_id": "file-2"}, 400, "purpose 'batch'"),
                                  ({"file_id": "file-9"}, 400, "no file with id file-9"),
                                  ({"file_id": "file-1", "file_data": PDF_URL}, 400, "one of them"),
                                  ({"file_data": 5}, 400, "must be a string"),
                                  ({"file_data": "https://x/y.pdf"}, 422, "only data: URLs"),
                                  ({"file_data": "data:application/pdf;base64," +
                                    base64.b64encode(PDF[:3000]).decode()}, 422, "the PDF cannot be read"),
                                  ({"file_data": "data:application/zip;base64," +
                                    base64.b64encode(b"PK\x03\x04").decode()}, 415, "unsupported media type")]:
        bad = {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "file", "file": file}]}
        with pytest.raises(ApiError, match=message) as e:
            inline_files([{"role": "system", "content": "s"}, bad], records.get, OcrBudget())
        assert e.value.status_code == status and e.value.errors[0].path.startswith("messages.1.content.1"), file
    with pytest.raises(ApiError, match="image_url.url is required"):
        inline_files([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], no_files, OcrBudget())


def test_one_requests_ocr_pages_are_bounded_and_the_refusal_names_that_limit(monkeypatch):
    pages = iter([2, 2])

    def fake_ingest(data, media_type=None, name=None, *, limits=Limits()):
        need = next(pages)
        if need > limits.max_ocr_pages:
            raise IngestError(413, f"{need} pages to read by OCR; the limit is {limits.max_ocr_pages} pages")
        return SimpleNamespace(pages=[SimpleNamespace(ocr=True)] * need, text="t")

    monkeypatch.setattr(content, "ingest", fake_ingest)
    budget = OcrBudget(3)
    budget.read(b"scan")
    assert budget.left == 1
    with pytest.raises(IngestError, match=r"may have 3 pages read by OCR in all, 2 are taken") as e:
        budget.read(b"scan")
    assert e.value.status == 413 and budget.left == 1
