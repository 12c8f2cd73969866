"""Images that would cost a reader without limits gigabytes or seconds of header parsing:
refused from their headers, before any pixel is decoded, naming the limit's setting."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image

from bench.hostile import png_file
from structspec.ingest import IngestError, Limits, image, ingest, probe


def encoded(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def test_a_30000_by_30000_png_is_refused_by_probe_from_its_header():
    """900 million pixels (2.7 GB in RGB) in a 110 KB file."""
    png = png_file(30000, 30000)
    assert len(png) < 200_000
    for read in (probe, ingest):
        t = time.perf_counter()
        with pytest.raises(IngestError, match=r"the image is 30000 x 30000 pixels \(900000000\); the limit is 50000000 "
                                              r"pixels \(ingest_max_page_pixels\)") as e:
            read(png)
        print(f"{read.__name__}: refused in {time.perf_counter() - t:.4f} s")
        assert (e.value.status, e.value.code) == (413, "file_too_large")


def test_the_page_pixel_limit_is_the_setting_not_pillows_own(monkeypatch):
    """Pillow refuses over 2 x Image.MAX_IMAGE_PIXELS in Image.open (179 million by default):
    the settings decide, above and below it."""
    png = png_file(15000, 15000)  # 225 million pixels
    assert probe(png, limits=Limits(max_page_pixels=300_000_000)).pages == 1
    with pytest.raises(IngestError, match=r"\(ingest_max_page_pixels\)"):
        probe(encoded(Image.new("1", (200, 200)), "PNG"), limits=Limits(max_page_pixels=39_999))


def test_frames_over_the_document_pixel_budget_are_refused_before_any_is_decoded(monkeypatch):
    monkeypatch.setattr(image, "_decode", lambda *a: pytest.fail("decoded"))
    page = Image.new("RGB", (1000, 1000), "white")
    tiff = encoded(page, "TIFF", save_all=True, append_images=[page, page])
    for read in (probe, ingest):
        with pytest.raises(IngestError, match=r"the image's 3 frames take the document to 3000000 pixels decoded or "
                                              r"rendered; the limit is 2500000 pixels \(ingest_max_document_pixels\)"):
            read(tiff, limits=Limits(max_document_pixels=2_500_000))


def test_a_tiff_with_more_frames_than_the_limits_is_refused_and_its_frames_counted_no_further():
    page = Image.new("1", (10, 10))
    tiff = encoded(page, "TIFF", save_all=True, append_images=[page] * 29)  # 30 frames
    with pytest.raises(IngestError, match=r"the image has at least 21 pages to read by OCR; the limit is 20 pages "
                                          r"\(ingest_max_ocr_pages\)") as e:
        probe(tiff)
    assert e.value.status == 413
    with pytest.raises(IngestError, match=r"the image has at least 6 pages; the limit is 5 pages \(ingest_max_pages\)"):
        probe(tiff, limits=Limits(max_pages=5))


@pytest.mark.parametrize("kind, data", [
    ("PNG", encoded(Image.new("1", (10, 10)), "PNG")[:33]  # the signature and IHDR, then a million empty chunks
     + b"\x00\x00\x00\x00zzZz\x00\x00\x00\x00" * 1_000_000),
    ("JPEG", b"\xff\xd8" + b"\xff\xe5\x00\x02" * 1_000_000 + encoded(Image.new("L", (10, 10)), "JPEG")[2:]),
], ids=["png-chunks", "jpeg-segments"])
def test_an_image_with_a_million_parts_before_its_pixels_is_refused_without_parsing_them(kind, data):
    """Pillow parses each in Python: a million PNG chunks took its header read 4.4 s here."""
    t = time.perf_counter()
    with pytest.raises(IngestError, match=rf"more than 1000 (chunks|segments) before .*not a {kind}") as e:
        probe(data)
    print(f"refused in {time.perf_counter() - t:.4f} s")
    assert e.value.code == "file_unreadable"


def test_ordinary_images_pass_the_layout_walk():
    img = Image.new("RGB", (40, 30), "white")
    exif = Image.Exif()
    exif[0x0112] = 6
    for fmt, kwargs in [("PNG", {"dpi": (300, 300)}), ("JPEG", {"exif": exif, "dpi": (300, 300)}),
                        ("TIFF", {"save_all": True, "append_images": [img]})]:
        got = probe(encoded(img, fmt, **kwargs))
        assert got.media_type == f"image/{fmt.lower()}" and got.pages == (2 if fmt == "TIFF" else 1)
