"""Files as the API's bodies carry them (structspec/api/services/content.py) and the OpenAI
file content parts that become message text (structspec/api/services/openai.py file_parts: checked
in the request, their text put in place by the reader, worker/ingest.py): the real invoice PDF
of tests/fixtures/invoices (MIT, see LICENSE.md there)."""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace

import pytest

from structspec.api.errors import ApiError
from structspec.api.services.content import data_url, decode_base64
from structspec.api.services.openai import file_parts
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


def inline_files(messages, files):
    """file_parts, then what the reader does: each deferred file's text in its place."""
    out, deferred = file_parts(messages, files, Limits())
    for (m, p), file in (deferred.files if deferred else ()):
        assert out[m]["content"][p] == {"type": "text", "text": ""}  # left for the reader
        out[m]["content"][p] = {"type": "text", "text": ingest(file.source or PDF, file.media_type).text}
    return out


def test_a_file_part_becomes_the_pdfs_text_set_apart_from_the_text_beside_it():
    text = ingest(PDF).text
    messages = [{"role": "system", "content": "Extract."},
                {"role": "user", "content": [{"type": "text", "text": "The invoice:"},
                                             {"type": "file", "file": {"file_data": PDF_URL, "filename": "a.pdf"}},
                                             {"type": "text", "text": "Thanks."}]}]
    out = inline_files(messages, no_files)
    assert out[0] is messages[0]  # messages without a file part are left as they are
    assert "".join(p["text"] for p in out[1]["content"]) == f"The invoice:\n\n{text}\n\nThanks."
    alone = inline_files([{"role": "user", "content": [{"type": "file", "file": {"file_data": PDF_URL}}]}], no_files)
    assert "".join(p["text"] for p in alone[0]["content"]) == text
    two = inline_files([{"role": "user", "content": [{"type": "file", "file": {"file_data": PDF_URL}}] * 2}],
                       no_files)
    assert "".join(p["text"] for p in two[0]["content"]) == f"{text}\n\n{text}"  # one blank line between


def test_a_pdf_part_is_left_for_the_reader_and_a_text_part_is_put_in_place_now():
    text_url = "data:text/plain;base64," + base64.b64encode(b"plain words").decode()
    out, deferred = file_parts([{"role": "user", "content": [{"type": "file", "file": {"file_data": PDF_URL}},
                                                             {"type": "file", "file": {"file_data": text_url}}]}],
                               no_files, Limits())
    assert [p["text"] for p in out[0]["content"]] == ["", "\n\n", "plain words"]
    [((m, p), file)] = deferred.files
    assert (m, p, file.source, file.media_type) == (0, 0, PDF, "application/pdf")
    columns = deferred.columns()
    assert columns["phase"] == "reading" and columns["source"] == PDF
    assert columns["intake"] == {"files": [{"offset": 0, "length": len(PDF), "media_type": "application/pdf",
                                            "at": [0, 0]}]}


def test_an_uploaded_user_data_file_is_named_by_its_id_and_other_purposes_are_refused():
    records = {"file-1": SimpleNamespace(id="file-1", purpose="user_data", media_type="application/pdf",
                                         filename="inv.pdf"),
               "file-2": SimpleNamespace(id="file-2", purpose="batch", media_type=None, filename="in.jsonl")}
    part = {"type": "file", "file": {"file_id": "file-1"}}
    out, deferred = file_parts([{"role": "user", "content": [part]}], records.get, Limits())
    [(at, file)] = deferred.files
    assert at == (0, 0)
    assert (file.file_id, file.source, file.name) == ("file-1", None, "inv.pdf")
    assert deferred.columns()["intake"]["files"] == [{"file_id": "file-1", "media_type": "application/pdf",
                                                      "name": "inv.pdf", "at": [0, 0]}]
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
            file_parts([{"role": "system", "content": "s"}, bad], records.get, Limits())
        assert e.value.status_code == status and e.value.errors[0].path.startswith("messages.1.content.1"), file
    with pytest.raises(ApiError, match="image_url.url is required"):
        file_parts([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], no_files, Limits())
