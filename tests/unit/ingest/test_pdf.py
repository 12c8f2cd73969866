"""PDFs that would cost a reader without limits gigabytes or minutes (issue 63): each is
refused, or read at a lower resolution, within the budgets, and the error names the limit's
setting. The files are built here by bench.hostile, a few kilobytes each."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.hostile import big_page_pdf, flate_bomb_pdf, image_in_pdf, object_stream_bomb_pdf, pages_pdf, \
    repair_pdf
from structspec.ingest import IngestError, Limits, ingest, ocr, pdf, probe


def refused(data: bytes, status: int, code: str, message: str, read=ingest, **limits) -> IngestError:
    with pytest.raises(IngestError, match=message) as e:
        read(data, limits=Limits(**limits))
    assert (e.value.status, e.value.code) == (status, code), str(e.value)
    return e.value


def test_a_200_inch_scanned_page_is_rendered_within_the_page_pixel_limit_with_a_warning(monkeypatch):
    """The 1 KB file of issue 63: at 216 dpi its page is 43200 x 43200 pixels (7.5 GB in RGBA)."""
    seen = []
    monkeypatch.setattr(ocr, "find_lines", lambda image, dpi, budget, page: seen.append((image.size, dpi)) or [])
    data = big_page_pdf()
    assert len(data) < 1024
    error = refused(data, 422, "no_text_found", "no text layer, and OCR found no text")
    [((width, height), dpi)] = seen
    assert width * height <= Limits().max_page_pixels and width > 7000 and round(dpi) == 35
    # the refusal says why OCR may have read nothing
    assert ("page 1 is 14400 x 14400 points: rendered at 35 dpi instead of 216 to stay within 50000000 pixels "
            "(ingest_max_page_pixels)") in str(error)


def test_a_page_rendered_smaller_says_so_in_the_documents_warnings(monkeypatch):
    monkeypatch.setattr(ocr, "find_lines", lambda image, dpi, budget, page: [
        ocr.Line([ocr.Word("Total", (10, 10, 60, 30), 95)], 10, 10, 60, 30)])
    doc = ingest(pages_pdf(1), limits=Limits(max_page_pixels=1_000_000))  # a letter page at 216 dpi is 4.5 million
    assert doc.text == "Total"
    assert doc.warnings == ["page 1 is 612 x 792 points: rendered at 103 dpi instead of 216 to stay within 1000000 "
                            "pixels (ingest_max_page_pixels)"]
    assert not ingest(pages_pdf(1)).warnings  # at the default limit it is rendered at 216 dpi, no warning


@pytest.mark.parametrize("width, height, max_pixels", [(14400, 14400, 50_000_000), (612, 792, 1_000_000),
                                                       (14400, 10, 50_000_000), (1e6, 1e6, 50_000_000)])
def test_the_render_scale_keeps_the_bitmap_within_the_pixels_and_tesseracts_side_limit(width, height, max_pixels):
    scale = pdf.render_scale(width, height, max_pixels)
    w, h = math.ceil(width * scale), math.ceil(height * scale)  # as pypdfium2 sizes the bitmap
    assert w * h <= max_pixels and max(w, h) <= ocr.MAX_SIDE and 0 < scale <= pdf.OCR_SCALE
    assert w * h > 0.99 * min(max_pixels, width * height * 9) or max(w, h) > 0.99 * ocr.MAX_SIDE  # not needlessly small


def test_scanned_pages_over_the_document_pixel_budget_are_refused_before_any_is_rendered(monkeypatch):
    monkeypatch.setattr(ocr, "find_lines", lambda *a: pytest.fail("OCR ran"))
    # two letter pages at 216 dpi: 1836 x 2376 pixels each, 8.7 million together
    refused(pages_pdf(2), 413, "file_too_large", r"the PDF's 2 scanned pages, rendered for OCR, take the document to "
            r"8724672 pixels decoded or rendered; the limit is 8000000 pixels \(ingest_max_document_pixels\)",
            max_document_pixels=8_000_000)


def test_more_pages_than_the_limit_are_refused_by_probe_and_by_ingest():
    for read in (probe, ingest):
        refused(pages_pdf(3), 413, "file_too_large", r"the PDF has 3 pages; the limit is 2 pages \(ingest_max_pages\)",
                read=read, max_pages=2)


def test_a_flate_stream_inflating_past_the_limit_is_refused_before_pdfium_reads_it(monkeypatch):
    bomb = flate_bomb_pdf(1_000_000)  # 1 MB of zeros, then a line of text: 1.6 KB
    assert len(bomb) < 2000 and "Hello" in ingest(bomb).text  # under the default limit, it is read
    monkeypatch.setattr(pdf, "open_pdf", lambda data: pytest.fail("PDFium opened it"))
    refused(bomb, 413, "file_too_large", r"the PDF's Flate streams decompress to more than 500000 bytes; the limit is "
            r"500000 bytes \(ingest_max_decompressed_mb\)", max_decompressed_bytes=500_000)


def test_an_object_stream_bomb_is_refused_by_probe_before_pdfium_opens_it():
    """PDFium inflates a file's object streams to open it: 1 GiB took it 4.7 s and 1.9 GB here."""
    bomb = object_stream_bomb_pdf(64 * 1024 * 1024)
    assert len(bomb) < 100_000
    refused(bomb, 413, "file_too_large", r"cross-reference and object streams decompress to more than 33554432 bytes "
            r".*1/16 of ingest_max_decompressed_mb", read=probe)


def test_probe_counts_only_structure_streams_and_ingest_all_of_them():
    small = object_stream_bomb_pdf(100_000)
    assert pdf.inflate_check(small, Limits(), structure_only=True) == 100_000
    assert pdf.inflate_check(flate_bomb_pdf(1_000_000), Limits(), structure_only=True) == 0
    assert pdf.inflate_check(flate_bomb_pdf(1_000_000), Limits()) > 1_000_000


def test_a_million_tiny_structure_streams_cost_probe_no_more_than_8192_of_them():
    tiny = b"1 0 obj\n<< /Type /ObjStm /Filter /FlateDecode >>stream\nx\x9c\x03\x00\x00\x00\x00\x01\nendstream\n"
    with pytest.raises(IngestError, match=r"each counted as at least 4096") as e:
        pdf.inflate_check(b"%PDF-1.7\n" + tiny * 1_000_000, Limits(), structure_only=True)
    assert e.value.status == 413


def test_an_image_drawn_on_a_scanned_page_over_the_page_pixel_limit_is_refused_before_rendering(monkeypatch):
    """PDFium decodes an image at its own size, whatever size it is drawn at: 900 million pixels."""
    monkeypatch.setattr(pdf, "_read_scan", lambda *a: pytest.fail("rendered"))
    refused(image_in_pdf(30000, 30000), 413, "file_too_large", r"page 1 of the PDF draws an image of 30000 x 30000 "
            r"pixels \(900000000\); the limit is 50000000 pixels \(ingest_max_page_pixels\)")


def test_a_pdf_that_pdfium_would_take_minutes_to_open_is_refused_by_probe_in_seconds(monkeypatch):
    """Objects with streams and no `endobj`, no cross-reference: PDFium's repair of these 660 KB
    took 26 s here, and grows with the square of the size."""
    from structspec.ingest import isolated

    monkeypatch.setattr(isolated, "PROBE_OPEN_TIMEOUT_S", 1.0)
    data = repair_pdf()
    refused(data, 422, "read_timeout", r"opening the PDF took longer than 1 s .*ingest_timeout_s", read=probe)


def test_the_document_time_limit_is_checked_between_pages():
    refused(pages_pdf(2, content=b"BT /F1 12 Tf 72 700 Td (Hi) Tj ET", resources=b"/Font << /F1 << /Type /Font "
                      b"/Subtype /Type1 /BaseFont /Helvetica >> >>"), 422, "read_timeout",
            r"reading the document took longer than its limit of 1e-06 s \(ingest_timeout_s\).*before the text of "
            r"page 1",
            timeout_s=1e-6)


def test_an_encrypted_pdf_has_its_own_code():
    data = (Path(__file__).resolve().parents[2] / "fixtures" / "encrypted.pdf").read_bytes()
    for read in (probe, ingest):
        refused(data, 422, "file_encrypted", "encrypted", read=read)
