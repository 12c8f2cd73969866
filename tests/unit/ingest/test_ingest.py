"""Ingestion: PDFs with a text layer give text whose every character keeps its page and box,
and bad files are refused naming the problem (images and scans: test_ocr.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pypdfium2 as pdfium
import pypdfium2.raw as raw
import pytest

from structspec.ingest import IngestError, Limits, Probe, detect, ingest, probe

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
AZURE = FIXTURES / "invoices" / "AzureInterior.pdf"
QUALITY = FIXTURES / "invoices" / "QualityHosting.pdf"


def page_chars(path: Path) -> dict[tuple[int, tuple[float, ...]], str]:
    """Every drawn character of every page, keyed by (page, its box from the top-left), read
    straight from PDFium: the reference the ingested document is checked against."""
    pdf = pdfium.PdfDocument(path.read_bytes())
    out = {}
    for index in range(len(pdf)):
        page = pdf[index]
        height = page.get_size()[1]
        textpage = page.get_textpage()
        for i in range(textpage.count_chars()):
            if raw.FPDFText_IsGenerated(textpage.raw, i):
                continue
            left, bottom, right, top = textpage.get_charbox(i)
            if right > left:
                out[(index + 1, (left, height - top, right, height - bottom))] = chr(raw.FPDFText_GetUnicode(textpage.raw, i))
    return out


@pytest.mark.parametrize("path", [AZURE, QUALITY], ids=lambda p: p.stem)
def test_every_placed_character_is_the_character_drawn_in_that_box(path):
    doc = ingest(path.read_bytes(), name=path.name)
    reference = page_chars(path)
    assert doc.media_type == "application/pdf" and len(doc.chars) == len(doc.text)
    placed = [(i, place) for i, place in enumerate(doc.chars) if place is not None]
    assert len(placed) > 0.8 * len(doc.text)
    for i, place in placed:
        assert reference[(place.page, place.box)] == doc.text[i], (i, doc.text[max(0, i - 20):i + 20])
    # and nothing drawn was left out but blank space at the ends of lines
    placed_boxes = {(place.page, place.box) for _, place in placed}
    missing = [ch for key, ch in reference.items() if key not in placed_boxes]
    assert all(ch.isspace() or ord(ch) < 32 for ch in missing), missing[:20]


def test_a_value_gets_the_union_of_its_characters_boxes_on_its_page():
    doc = ingest(AZURE.read_bytes())
    value = "INV/2023/03/0008"
    start = doc.text.index(value)
    [where] = doc.locate(start, start + len(value))
    reference = page_chars(AZURE)
    # the boxes of the drawn characters that spell the value, found independently: the run of
    # reference characters equal to the value on one line
    boxes = [box for (page, box), ch in reference.items() if page == 1]
    chars_in = [(box, ch) for (page, box), ch in reference.items()
                if page == 1 and where["box"][0] - 0.01 <= box[0] and box[2] <= where["box"][2] + 0.01
                and where["box"][1] - 0.01 <= box[1] and box[3] <= where["box"][3] + 0.01]
    assert "".join(ch for _, ch in sorted(chars_in)) == value  # the box holds exactly the value's characters
    x0, y0, x1, y1 = where["box"]
    assert where["page"] == 1 and x0 < x1 and y0 < y1 and boxes


def test_a_value_on_the_second_page_and_one_over_two_lines():
    doc = ingest(QUALITY.read_bytes())
    assert [p.number for p in doc.pages] == [1, 2] and doc.pages[0].unit == "pt"
    second = doc.text.index("\n\n") + 2  # pages are separated by a blank line
    last_line = doc.text.rstrip().rsplit("\n", 1)[1]
    start = doc.text.rindex(last_line)
    assert start > second and {w["page"] for w in doc.locate(start, start + len(last_line))} == {2}
    # two lines in one span: one box per line, the first above the second
    first_nl = doc.text.index("\n", 5)
    places = doc.locate(0, first_nl + 6)
    assert len(places) == 2 and places[0]["box"][3] <= places[1]["box"][1] + 0.5


def test_reading_order_puts_rows_top_to_bottom():
    doc = ingest(AZURE.read_bytes())
    tops = []
    for line_start in [0] + [i + 1 for i, c in enumerate(doc.text) if c == "\n"]:
        place = next((p for p in doc.chars[line_start:line_start + 40] if p is not None), None)
        if place is not None:
            tops.append((place.page, place.box[1]))
    assert tops == sorted(tops, key=lambda t: t[0]) and all(
        a[1] <= b[1] + 3 for a, b in zip(tops, tops[1:]) if a[0] == b[0])


def test_the_expected_fields_are_in_the_text():
    doc = ingest(AZURE.read_bytes())
    expected = json.loads((FIXTURES / "invoices" / "AzureInterior.json").read_text())[0]
    for key in ("invoice_number", "partner_street", "partner_city", "partner_zip", "payment_reference"):
        assert expected[key] in doc.text, key


def test_text_is_text_and_has_no_boxes():
    doc = ingest("Total: 4,11 €\n".encode(), name="x.txt")
    assert doc.text == "Total: 4,11 €\n" and not doc.has_layout and doc.locate(0, 5) == []


def blank_pdf() -> bytes:
    pdf = pdfium.PdfDocument.new()
    pdf.new_page(200, 200)
    buf = io.BytesIO()
    pdf.save(buf)
    return buf.getvalue()


PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32


@pytest.mark.parametrize("data, kwargs, status, message", [
    (AZURE.read_bytes()[:5000], {}, 422, "the PDF cannot be read"),
    ((FIXTURES / "encrypted.pdf").read_bytes(), {}, 422, "encrypted"),
    (blank_pdf(), {}, 422, "no text layer"),
    (PNG, {"name": "scan.png"}, 422, "the image cannot be read"),
    (b"PK\x03\x04zip", {"media_type": "application/zip"}, 415, "unsupported media type application/zip"),
    (b"x" * 101, {"limits": Limits(max_bytes=100)}, 413, r"101 bytes; the limit is 100 bytes \(max_file_bytes\)"),
    (b"caf\xe9", {}, 422, r"not UTF-8 text \(byte 3"),
    (b"a\x00b", {}, 422, "NUL"),
], ids=["truncated-pdf", "encrypted-pdf", "blank-pdf", "corrupt-image", "zip", "too-large", "latin-1", "nul"])
def test_bad_files_are_refused_naming_the_problem(data, kwargs, status, message):
    with pytest.raises(IngestError, match=message) as e:
        ingest(data, **kwargs)
    assert e.value.status == status


def test_magic_bytes_win_over_the_name_and_the_media_type():
    assert detect(AZURE.read_bytes()[:8], "text/plain", "a.txt") == "application/pdf"
    assert detect(PNG, None, "a.pdf") == "image/png"
    assert detect(b"hello", "text/markdown; charset=utf-8") == "text/markdown"
    assert detect(b"hello", None, "notes.PDF") == "application/pdf"  # then refused as unreadable
    with pytest.raises(IngestError, match="cannot be read"):
        ingest(b"hello", name="notes.pdf")


def test_probe_answers_the_media_type_and_pages_of_what_ingest_reads():
    assert probe(QUALITY.read_bytes()) == Probe("application/pdf", 2)
    assert probe("Total: 4,11 €".encode(), "text/markdown") == Probe("text/plain", 1)
    assert probe(blank_pdf()) == Probe("application/pdf", 1)  # ingest refuses it later: nothing to read


@pytest.mark.parametrize("data, kwargs, status, code, message", [
    (b"x" * 101, {"limits": Limits(max_bytes=100)}, 413, "file_too_large", r"\(max_file_bytes\)"),
    (b"PK\x03\x04zip", {"media_type": "application/zip"}, 415, "unsupported_media_type", "unsupported media type"),
    (b"caf\xe9", {}, 422, "file_unreadable", "not UTF-8 text"),
    (b"a\x00b", {}, 422, "file_unreadable", "NUL"),
    (AZURE.read_bytes()[:5000], {}, 422, "file_unreadable", "the PDF cannot be read"),
    (PNG, {}, 422, "file_unreadable", "the image cannot be read"),
], ids=["too-large", "zip", "latin-1", "nul", "truncated-pdf", "corrupt-png"])
def test_probe_refuses_what_ingest_refuses_without_reading_it(data, kwargs, status, code, message):
    for read in (probe, ingest):
        with pytest.raises(IngestError, match=message) as e:
            read(data, **kwargs)
        assert (e.value.status, e.value.code) == (status, code)


def test_running_out_of_memory_while_reading_is_an_ingest_error(monkeypatch):
    from structspec.ingest import pdf

    def exhausted(*args):
        raise MemoryError

    monkeypatch.setattr(pdf, "open_pdf", exhausted)
    with pytest.raises(IngestError, match="reading the file ran out of memory") as e:
        ingest(AZURE.read_bytes())
    assert (e.value.status, e.value.code) == (413, "read_memory")
