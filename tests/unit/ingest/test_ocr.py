"""OCR: images, and PDF pages without a text layer, read by Tesseract into text whose every
character keeps its page and box. The pages are real invoices rendered here with pypdfium2,
so the PDF's own text layer says what the OCR should read and where each word sits.

These tests need the `tesseract` command (Debian: apt-get install tesseract-ocr); without it
they fail saying so, never skip."""

from __future__ import annotations

import io
import shutil
import time
from pathlib import Path

import pypdfium2 as pdfium
import pytest
from PIL import Image

from structspec.ingest import IngestError, Limits, decode_layout, encode_layout, ingest, ocr
from structspec.ingest.overlay import draw_boxes

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "invoices"
AZURE = FIXTURES / "AzureInterior.pdf"
QUALITY = FIXTURES / "QualityHosting.pdf"
SCALE = 3.0  # pixels per point of the rendered pages (216 dpi)
TOLERANCE_PT = 3.0  # an OCR word's box against the text layer's: a word's own edges, or a slice of it
WORDS = ["Azure Interior", "INV/2023/03/0008", "CUSTREF123", "Fremont", "United States", "US1234567890", "279.84"]


@pytest.fixture
def tesseract():
    if shutil.which("tesseract") is None:
        pytest.fail("the tesseract command is not installed: OCR cannot be tested (apt-get install tesseract-ocr)")


def render(path: Path, page: int = 0, scale: float = SCALE, crop: float = 1.0) -> Image.Image:
    """Page `page` of the PDF as an RGB image, its top `crop` fraction only."""
    pdf = pdfium.PdfDocument(path.read_bytes())
    try:
        image = pdf[page].render(scale=scale).to_pil().convert("RGB")
    finally:
        pdf.close()
    return image.crop((0, 0, image.width, round(image.height * crop)))


def encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def assert_same_box(got: list[float], want: list[float], word: str) -> None:
    assert all(abs(g - w) <= TOLERANCE_PT for g, w in zip(got, want)), (word, got, want)


@pytest.fixture(scope="module")
def azure_scan():
    """AzureInterior's page rendered to PNG and read back through OCR: (png, its Document)."""
    if shutil.which("tesseract") is None:
        pytest.fail("the tesseract command is not installed: OCR cannot be tested (apt-get install tesseract-ocr)")
    png = encoded(render(AZURE), "PNG")
    return png, ingest(png, "image/png", "azure.png")


def test_a_rendered_page_reads_back_its_words_each_in_its_text_layer_box(azure_scan):
    png, doc = azure_scan
    reference = ingest(AZURE.read_bytes())
    width, height = Image.open(io.BytesIO(png)).size
    assert doc.media_type == "image/png" and len(doc.chars) == len(doc.text)
    assert [(p.number, p.width, p.height, p.unit, p.ocr) for p in doc.pages] == [(1, width, height, "px", True)]
    for word in WORDS:
        assert word in doc.text, word
        start, ref_start = doc.text.index(word), reference.text.index(word)
        [got] = doc.locate(start, start + len(word))
        [want] = reference.locate(ref_start, ref_start + len(word))
        assert got["page"] == want["page"] == 1
        assert_same_box([v / SCALE for v in got["box"]], want["box"], word)


def test_ocr_text_runs_top_to_bottom_one_line_per_ocr_line(azure_scan):
    _, doc = azure_scan
    tops = []
    for n, line in enumerate(doc.text.split("\n")):
        start = sum(len(x) + 1 for x in doc.text.split("\n")[:n])
        places = [p for p in doc.chars[start:start + len(line)] if p is not None]
        assert places and len({p.line for p in places}) == 1, line  # one OCR line per text line
        tops.append(min(p.box[1] for p in places))
    assert all(a <= b + 3 * SCALE for a, b in zip(tops, tops[1:]))
    # the characters between words and lines have no box; every other one has
    assert all((place is None) == ch.isspace() for ch, place in zip(doc.text, doc.chars))


def test_an_image_layout_is_stored_and_read_back_with_its_unit(azure_scan):
    _, doc = azure_scan
    back = decode_layout(doc.text, encode_layout(doc))
    assert back.pages == doc.pages and back.pages[0].unit == "px" and back.pages[0].ocr
    start = doc.text.index("CUSTREF123")
    assert back.locate(start, start + 10) == doc.locate(start, start + 10)


def test_the_overlay_of_an_image_is_drawn_on_the_image_itself(azure_scan, tmp_path):
    png, doc = azure_scan
    start = doc.text.index("CUSTREF123")
    boxes = {"/ref": doc.locate(start, start + 10)}
    [path] = draw_boxes(doc, boxes, tmp_path, "azure")
    drawn, original = Image.open(path).convert("RGB"), Image.open(io.BytesIO(png)).convert("RGB")
    assert path.name == "azure-page1.png" and drawn.size == original.size
    x0, y0, x1, y1 = boxes["/ref"][0]["box"]
    red = (0xD6, 0x27, 0x28)  # the first pointer's colour
    band = [(x, round((y0 + y1) / 2)) for x in range(round(x0) - 4, round(x0) + 2)]  # across the left edge
    assert any(drawn.getpixel(xy) == red for xy in band) and not any(original.getpixel(xy) == red for xy in band)


def test_a_pdf_holding_only_a_scanned_page_is_read_by_ocr_in_points(tesseract):
    scan = encoded(render(AZURE), "PDF", resolution=72 * SCALE)  # one image, no text: the page is 595x842 pt
    doc = ingest(scan, name="scan.pdf")
    reference = ingest(AZURE.read_bytes())
    assert doc.media_type == "application/pdf"
    assert [(p.unit, p.ocr, round(p.width), round(p.height)) for p in doc.pages] == [("pt", True, 595, 842)]
    for word in WORDS:
        start, ref_start = doc.text.index(word), reference.text.index(word)
        [got] = doc.locate(start, start + len(word))
        [want] = reference.locate(ref_start, ref_start + len(word))
        assert_same_box(got["box"], want["box"], word)


def test_a_pdf_mixing_a_text_page_and_a_scanned_page_reads_both_in_points(tesseract):
    scanned = pdfium.PdfDocument(encoded(render(QUALITY, crop=0.4), "PDF", resolution=72 * SCALE))
    mixed = pdfium.PdfDocument(AZURE.read_bytes())
    mixed.import_pages(scanned)
    buf = io.BytesIO()
    mixed.save(buf)
    doc = ingest(buf.getvalue())
    text_page = ingest(AZURE.read_bytes())
    assert [(p.number, p.unit, p.ocr) for p in doc.pages] == [(1, "pt", False), (2, "pt", True)]
    assert doc.text.startswith(text_page.text + "\n\n")  # page 1 is its text layer, as before
    assert doc.chars[:len(text_page.chars)] == text_page.chars
    reference = ingest(QUALITY.read_bytes())
    word = "QualityHosting AG"
    start, ref_start = doc.text.index(word, len(text_page.text)), reference.text.index(word)
    [got] = doc.locate(start, start + len(word))
    [want] = reference.locate(ref_start, ref_start + len(word))
    assert got["page"] == 2 and want["page"] == 1
    assert_same_box(got["box"], want["box"], word)


def test_each_frame_of_a_tiff_is_a_page(tesseract):
    top = [render(AZURE, crop=0.2), render(QUALITY, crop=0.2)]
    tiff = encoded(top[0], "TIFF", save_all=True, append_images=top[1:], dpi=(216, 216))
    doc = ingest(tiff, name="two.tiff")
    assert doc.media_type == "image/tiff" and [(p.number, p.unit) for p in doc.pages] == [(1, "px"), (2, "px")]
    first, second = doc.text.split("\n\n")
    assert "Azure Interior" in first and "QualityHosting" in second
    start = doc.text.index("QualityHosting")
    assert {place["page"] for place in doc.locate(start, start + 14)} == {2}


def test_a_jpeg_turned_by_its_exif_orientation_gets_boxes_on_the_upright_image(tesseract):
    upright = render(AZURE, crop=0.15)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: display rotated 90 degrees clockwise
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # what a camera held sideways writes
    doc = ingest(encoded(stored, "JPEG", quality=95, exif=exif, dpi=(216, 216)), name="photo.jpg")
    reference = ingest(encoded(upright, "PNG", dpi=(216, 216)), name="upright.png")
    assert (doc.pages[0].width, doc.pages[0].height) == upright.size
    start, ref_start = doc.text.index("Azure Interior"), reference.text.index("Azure Interior")
    [got], [want] = doc.locate(start, start + 14), reference.locate(ref_start, ref_start + 14)
    assert_same_box([v / SCALE for v in got["box"]], [v / SCALE for v in want["box"]], "Azure Interior")


def test_coloured_text_as_bright_as_its_background_is_read(tesseract):
    """Red ink on green of the same luma: a grey conversion by brightness leaves a blank page."""
    top = render(AZURE, crop=0.2).convert("L")
    red, green = Image.new("RGB", top.size, (200, 0, 0)), Image.new("RGB", top.size, (0, 102, 0))
    coloured = Image.composite(green, red, top)  # the page's white becomes green, its ink red
    assert coloured.convert("L").getextrema() == (59, 60)
    doc = ingest(encoded(coloured, "PNG", dpi=(216, 216)))
    assert "Azure Interior" in doc.text and "Global Wholesaler" in doc.text


def test_an_image_or_a_scanned_pdf_without_text_is_refused_naming_the_file(tesseract):
    white = Image.new("RGB", (1240, 1754), "white")
    with pytest.raises(IngestError, match="no text found in the image blank.png") as e:
        ingest(encoded(white, "PNG"), name="blank.png")
    assert (e.value.status, e.value.code) == (422, "no_text_found")
    with pytest.raises(IngestError, match=r"no text layer, and OCR found no text on its scanned pages \(1\)") as e:
        ingest(encoded(white, "PDF", resolution=150))
    assert e.value.status == 422


@pytest.mark.parametrize("data, kind", [
    (b"\x89PNG\r\n\x1a\n" + bytes(32), "PNG"),
    (encoded(Image.effect_noise((300, 200), 60).convert("RGB"), "PNG")[:2000], "PNG"),  # truncated
    (b"\xff\xd8\xff\xe0" + bytes(64), "JPEG"),
    (b"II*\x00" + bytes(64), "TIFF"),
], ids=["png-garbage", "png-truncated", "jpeg-garbage", "tiff-garbage"])
def test_a_corrupt_image_is_refused_before_any_ocr(data, kind):
    with pytest.raises(IngestError, match=f"the image cannot be read: .*not a {kind}") as e:
        ingest(data)
    assert e.value.status == 422 and "0x" not in str(e.value)  # no Python object's repr in the message


def test_more_pages_to_ocr_than_the_limit_are_refused_before_any_ocr():
    page = Image.new("RGB", (200, 200), "white")
    tiff = encoded(page, "TIFF", save_all=True, append_images=[page, page])
    with pytest.raises(IngestError, match=r"the image has 3 pages to read by OCR; the limit is 2 pages "
                                          r"\(ingest_max_ocr_pages\)") as e:
        ingest(tiff, limits=Limits(max_ocr_pages=2))
    assert e.value.status == 413
    scans = encoded(page, "PDF", save_all=True, append_images=[page])
    with pytest.raises(IngestError, match=r"the PDF has 2 pages to read by OCR; the limit is 1 pages "
                                          r"\(ingest_max_ocr_pages\)") as e:
        ingest(scans, limits=Limits(max_ocr_pages=1))
    assert e.value.status == 413


def test_without_tesseract_images_are_refused_naming_what_to_install(monkeypatch):
    monkeypatch.setattr(ocr.shutil, "which", lambda name: None)
    ocr.engine.cache_clear()
    try:
        with pytest.raises(IngestError, match="apt-get install tesseract-ocr") as e:
            ingest(encoded(Image.new("RGB", (200, 200), "white"), "PNG"))
        assert (e.value.status, e.value.code) == (415, "ocr_unavailable")
    finally:
        ocr.engine.cache_clear()


def test_each_character_takes_its_slice_of_its_word_and_spaces_have_none():
    tsv = ("level\tpage_num\tblock_num\tpar_num\tline_num\tword_num\tleft\ttop\twidth\theight\tconf\ttext\n"
           "1\t1\t0\t0\t0\t0\t0\t0\t900\t300\t-1\t\n"
           "5\t1\t1\t1\t2\t1\t100\t200\t40\t20\t96\tTotal\n"  # a lower line first: reading order moves it
           "5\t1\t1\t1\t2\t2\t160\t200\t60\t20\t95\t4,11\n"
           "5\t1\t1\t1\t1\t1\t100\t100\t30\t24\t91\tAbc\n"
           "5\t1\t1\t1\t1\t2\t150\t100\t10\t24\t80\t \n")  # a blank word (a rule): dropped
    lines = ocr.parse_tsv(tsv, k=2)  # the image was enlarged twice: boxes halve
    text, places = ocr.page_text(lines, page=3, first_line=7, scale=0.5)  # 0.5 px per unit: boxes double
    assert text == "Abc\nTotal 4,11"
    assert [p.box if p else None for p in places[:4]] == [(100, 100, 110, 124), (110, 100, 120, 124),
                                                          (120, 100, 130, 124), None]
    assert places[4].box == (100, 200, 108, 220) and places[9] is None and places[10].box == (160, 200, 175, 220)
    assert {(p.page, p.line) for p in places[:3]} == {(3, 7)} and {p.line for p in places[4:] if p} == {8}


def test_enlargement_stays_within_the_page_pixel_limit():
    small = Image.new("RGB", (1000, 1400), "white")  # 1.4 million pixels, 96 dpi: enlarged twice is 5.6 million
    assert ocr.enlargement(small, 96, max_pixels=5_600_000) == 2
    assert ocr.enlargement(small, 96, max_pixels=5_599_999) == 1


def test_an_ocr_run_past_its_page_limit_is_stopped_naming_the_setting(fake_tesseract):
    fake_tesseract("exec sleep 30")
    t = time.monotonic()
    with pytest.raises(IngestError, match=r"OCR of page 1 took longer than its limit of 0.5 s "
                                          r"\(ingest_ocr_page_timeout_s\)") as e:
        ingest(encoded(Image.new("RGB", (200, 200), "white"), "PNG"), limits=Limits(ocr_page_timeout_s=0.5))
    assert (e.value.status, e.value.code) == (422, "read_timeout") and time.monotonic() - t < 10


def test_an_ocr_run_is_stopped_when_the_document_runs_out_of_time(fake_tesseract):
    fake_tesseract("exec sleep 30")
    page = Image.new("RGB", (200, 200), "white")
    tiff = encoded(page, "TIFF", save_all=True, append_images=[page])
    with pytest.raises(IngestError, match=r"OCR of page 1 was stopped after .* s, when reading the document reached "
                                          r"its limit of 1 s \(ingest_timeout_s\)") as e:
        ingest(tiff, limits=Limits(timeout_s=1, ocr_page_timeout_s=60))
    assert (e.value.status, e.value.code) == (422, "read_timeout")


@pytest.mark.parametrize("body, status, code, message", [
    ('cat > /dev/null; echo "Error in pixCreateTemplate: pixd not made" >&2; exit 1', 413, "read_memory",
     r"OCR of page 1 ran out of memory \(tesseract exited with status 1: .*pixd not made\).*ingest_max_memory_mb"),
    ("cat > /dev/null; kill -SEGV $$", 422, "read_crashed", r"OCR of page 1 failed: tesseract exited with signal 11"),
], ids=["out-of-memory", "crash"])
def test_a_failing_tesseract_is_an_ingest_error_not_a_server_error(fake_tesseract, body, status, code, message):
    fake_tesseract(body)
    with pytest.raises(IngestError, match=message) as e:
        ingest(encoded(Image.new("RGB", (200, 200), "white"), "PNG"))
    assert (e.value.status, e.value.code) == (status, code)


def test_an_image_wider_than_tesseract_reads_is_shrunk_to_fit_with_a_warning(fake_tesseract):
    # the stand-in answers with the width of the PPM it was given ("P6\n<width> <height>\n255\n...")
    fake_tesseract('width=$(head -c 24 | tr "\\n" " " | cut -d " " -f 2); cat > /dev/null; '
                   'printf "%s\\n5\\t1\\t1\\t1\\t1\\t1\\t0\\t0\\t9\\t9\\t95\\tW=%s\\n" '
                   '"level\tpage_num\tblock_num\tpar_num\tline_num\tword_num\tleft\ttop\twidth\theight\tconf\ttext"'
                   ' "$width"')
    doc = ingest(encoded(Image.new("1", (40000, 8), 1), "PNG"))  # 320 000 pixels, but 40000 wide
    assert doc.text == "W=32767"
    assert doc.warnings == ["page 1 is 40000 x 8 pixels: read by OCR at 82% of its size, as Tesseract reads no side "
                            "over 32767 pixels"]
