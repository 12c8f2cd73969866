"""bench-documents reads what it can (scans through OCR), says why it cannot read the rest, and
grades fields."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench import documents

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "invoices"


def test_the_report_counts_files_pages_refusals_fields_and_boxes(tmp_path, monkeypatch, tiny_compact_engine):
    import io

    import pypdfium2 as pdfium

    from structspec.engine.engine import Engine

    monkeypatch.setattr(Engine, "from_settings", classmethod(lambda cls, settings: tiny_compact_engine))
    data = tmp_path / "invoices"
    data.mkdir()
    for name in ("AzureInterior", "QualityHosting"):
        shutil.copy(FIXTURES / f"{name}.pdf", data)
        shutil.copy(FIXTURES / f"{name}.json", data)
    pdf = pdfium.PdfDocument((FIXTURES / "AzureInterior.pdf").read_bytes())
    scan = pdf[0].render(scale=3).to_pil()
    buf = io.BytesIO()
    scan.crop((0, 0, scan.width, scan.height // 5)).save(buf, "PNG")  # a scan of the page's top: read by OCR
    (data / "top.png").write_bytes(buf.getvalue())
    (data / "scan.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))  # corrupt
    assert documents.main(["--dir", str(data), "--max-tokens", "96", "--no-ocr-compare",
                           "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "documents.json").read_text())
    assert (report["files"], report["read"], report["pages"]) == (4, 3, 4)
    assert (report["text_layer_pages"], report["ocr_pages"]) == (3, 1)
    assert report["text_layer_ms_per_page"] > 0 and report["ocr_ms_per_page"] > 0 and report["ocr_engines"] is None
    assert [(r["file"], r["status"]) for r in report["refused"]] == [("scan.png", 422)]
    assert [r["file"] for r in report["documents"] if r["ocr"]] == ["top.png"]
    assert set(report["per_field"]) == {"issuer", "invoice_number", "date", "amount", "currency"}
    assert report["per_field"]["issuer"]["expected"] == 2 and report["per_field"]["amount"]["expected"] == 2
    assert 0 <= report["string_values_with_a_box"] <= report["string_values"]
    for row in report["documents"]:  # every box names a page of its file
        assert all(b["page"] in (1, 2) for places in row["boxes"].values() for b in places)


def test_fields_are_compared_trimmed_case_folded_and_amounts_to_the_cent():
    assert documents.same("Coolblue B.V.", " coolblue b.v. ")
    assert documents.same(4.11, 4.114) and not documents.same(4.11, 4.12)
    assert not documents.same(4.11, "4.11") and not documents.same("x", None)
