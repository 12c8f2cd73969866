"""PDFs: the text of each page in reading order, and each character's box, in points.

pypdfium2 (Google's PDFium, the engine of Chrome's PDF viewer, as one wheel with no other
dependency) reads the text layer with a box per character in ~5 ms a page here; pdfplumber
(pdfminer.six, pure Python) gives the same boxes about two orders of magnitude slower.

PDFium returns the characters in content-stream order, which is the order a program drew
them in, not always the order a person reads them (one invoice here draws its footnotes
first). Lines are therefore put in reading order: top to bottom, and lines that share a row
(a label and its value, table cells) joined left to right with a space between them.

A page without a text layer that draws something (a scanned page) is rendered at 216 dpi and
read by OCR (ocr.py); its boxes are converted back to points, so a PDF mixing text and scanned
pages has one unit throughout.

Budgets (limits.py), so that a small file cannot cost unbounded memory or time:
- before PDFium sees the file, its Flate streams are inflated here, counting the bytes
  (inflate_check): more than ingest_max_decompressed_mb is refused (413), or more than 1/16 of
  it in cross-reference and object streams. probe() inflates those (what PDFium decodes to
  open the file and count its pages), read_pdf() every stream. Not covered: streams whose
  first filter is not Flate (LZW, RunLength, ASCII85/Hex before Flate, JBIG2, JPEG 2000) and
  names written with #-escapes; the isolated reading process's memory limit (read_isolated,
  ingest_max_memory_mb) is the backstop for those;
- ingest_max_pages and ingest_max_ocr_pages are counted before any page is rendered;
- a scanned page is rendered at a lower resolution when 216 dpi would take it over
  ingest_max_page_pixels (or a side over Tesseract's 32767 pixels), with a warning in the
  Document; an image drawn on it whose own pixels are over ingest_max_page_pixels is refused
  (PDFium decodes images at their full size); all scanned pages' rendered pixels together are
  held to ingest_max_document_pixels before the first is rendered;
- ingest_timeout_s is checked before each page, and bounds each page's OCR with
  ingest_ocr_page_timeout_s. One PDFium call (rendering a page of a million paths) is not
  interrupted: read_isolated's wall clock is the backstop.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass

from structspec.ingest import ocr
from structspec.ingest.document import Box, CharPlace, Document, IngestError, Page, rows
from structspec.ingest.limits import SETTINGS, Budget, Limits, check_ocr_pages, check_pages

MEDIA_TYPE = "application/pdf"
# pixels per point when a page without a text layer is rendered for OCR (216 dpi): Tesseract kept
# 0.96-0.97 of two invoices' words at 3, 0.87-0.96 at 2, and no more at 4.17 (300 dpi), 15% slower
OCR_SCALE = 3.0
INFLATE_CHUNK = 1024 * 1024  # bytes inflated at a time while counting: memory stays at this, whatever the stream
# The cross-reference and object streams (the file's structure, which PDFium inflates to open
# it) may take this share of ingest_max_decompressed_mb, so that probe() inflates at most 32 MiB
# by default, ~0.1 s here: they hold no page content and are well under 1 MiB for 200 pages
# of objects (the invoices of ../shared/data have none at all).
STRUCTURE_SHARE = 16
# and each counts as at least this much, so that a file of a million tiny ones is refused after
# 8192 (at the default) rather than costing probe() seconds of Python per stream
STRUCTURE_STREAM_BYTES = 4096

# `stream` and the end of line after it, where a stream's data starts (or `endstream`, which
# _next_stream skips: a lookbehind here would cost the search its fast literal prefix, 20x)
STREAM = re.compile(rb"stream(?:\r\n|\r|\n)")
FLATE_FIRST = re.compile(rb"/Filter\s*(?:\[\s*)?/(?:FlateDecode|Fl)(?![A-Za-z0-9])")
STRUCTURE = re.compile(rb"/Type\s*/(?:XRef|ObjStm)(?![A-Za-z0-9])")


@dataclass
class _Line:
    chars: list[tuple[str, Box | None]]  # (character, its box from the page's top-left corner)
    x0: float
    y0: float
    y1: float


def inflate_check(data: bytes, limits: Limits, structure_only: bool = False, budget: Budget | None = None) -> int:
    """The bytes the PDF's Flate streams inflate to (those of its cross-reference and object
    streams only, with `structure_only`); IngestError(413) as soon as they pass
    max_decompressed_bytes, or the cross-reference and object streams alone pass a
    STRUCTURE_SHARE of it (each counted as at least STRUCTURE_STREAM_BYTES). A stream is the
    data between `stream` and the next `endstream` (its /Length is not trusted); its
    dictionary, the text since the `obj` before it, says whether Flate is its first filter.
    Inflated a chunk at a time, nothing kept. `budget`: its time is checked every 4096 streams."""
    view = memoryview(data)
    structure_limit = limits.max_decompressed_bytes // STRUCTURE_SHARE
    total, structure, after, streams = 0, 0, 0, 0
    while True:
        match = _next_stream(data, after, structure_only)
        if not match:
            return total
        streams += 1
        if budget is not None and streams % 4096 == 0:
            budget.check_time("the PDF's streams were all counted")
        head_start = data.rfind(b"obj", after, match.start())
        head = data[head_start if head_start >= 0 else after:match.start()]
        end = data.find(b"endstream", match.end())
        after = len(data) if end < 0 else end
        is_structure = STRUCTURE.search(head) is not None
        if structure_only and not is_structure:
            continue
        size = 0
        if FLATE_FIRST.search(head):
            room = limits.max_decompressed_bytes - total
            size = _inflated_size(view[match.end():after], min(room, structure_limit - structure) if is_structure
                                  else room)
            total += size
        if is_structure:
            structure += max(size, STRUCTURE_STREAM_BYTES)
            if structure > structure_limit:
                raise IngestError(413, f"the PDF's cross-reference and object streams decompress to more than "
                                       f"{structure_limit} bytes (each counted as at least {STRUCTURE_STREAM_BYTES}); "
                                       f"the limit on them is 1/{STRUCTURE_SHARE} of "
                                       f"{SETTINGS['max_decompressed_bytes']} ({structure_limit} bytes)")
        if total > limits.max_decompressed_bytes:
            raise IngestError(413, f"the PDF's Flate streams decompress to more than {limits.max_decompressed_bytes} "
                                   f"bytes; the limit is {limits.max_decompressed_bytes} bytes "
                                   f"({SETTINGS['max_decompressed_bytes']})")


def _next_stream(data: bytes, start: int, structure_only: bool) -> re.Match | None:
    """The next `stream` keyword (not `endstream`) from `start`, with its end of line; with
    `structure_only`, the next after a cross-reference or object stream's /Type."""
    while True:
        if structure_only:
            kind = STRUCTURE.search(data, start)
            if not kind:
                return None
            start = kind.end()
        match = STREAM.search(data, start)
        if match is None or data[match.start() - 3:match.start()] != b"end":
            return match
        start = match.end()


def _inflated_size(raw: memoryview, budget: int) -> int:
    """How many bytes `raw` inflates to (zlib, else raw deflate), counting stopped once over
    `budget`; a corrupt stream counts what came out before the error, as PDFium keeps it."""
    for wbits in (zlib.MAX_WBITS, -zlib.MAX_WBITS):
        inflater, size, rest = zlib.decompressobj(wbits), 0, raw
        try:
            while rest and not inflater.eof and size <= budget:
                size += len(inflater.decompress(rest, INFLATE_CHUNK))
                rest = inflater.unconsumed_tail
        except zlib.error:
            if size == 0:
                continue  # no zlib header: try raw deflate
        return size
    return 0


def open_pdf(data: bytes):
    """The pypdfium2 PdfDocument of `data`; IngestError (422) for one that cannot be opened."""
    import pypdfium2 as pdfium

    try:
        return pdfium.PdfDocument(data)
    except pdfium.PdfiumError as e:
        if "password" in str(e).lower():
            raise IngestError(422, "the PDF is encrypted (it needs a password); send it decrypted",
                              code="file_encrypted") from None
        raise IngestError(422, f"the PDF cannot be read: {str(e).rstrip('.')} (corrupt or not a PDF)") from None


def probe_pdf(data: bytes, limits: Limits) -> int:
    """The PDF's page count, after the checks that take no rendering: its structure's Flate
    streams, that PDFium opens it (in a separate process bounded in time and memory:
    isolated.pdf_pages), its pages against max_pages."""
    from structspec.ingest.isolated import pdf_pages

    inflate_check(data, limits, structure_only=True)
    count = pdf_pages(data, limits)
    if count == 0:
        raise IngestError(422, "the PDF has no pages")
    check_pages(count, "the PDF", limits)
    return count


def render_scale(width: float, height: float, max_pixels: int) -> float:
    """Pixels per point to render a `width` x `height` point page for OCR: OCR_SCALE, or less
    so that the bitmap (ceil(width * scale) x ceil(height * scale), as pypdfium2 sizes it) has
    at most `max_pixels` pixels and no side over Tesseract's ocr.MAX_SIDE."""
    scale = min(OCR_SCALE, math.sqrt(max_pixels / (width * height)), ocr.MAX_SIDE / max(width, height))
    while scale > 0 and (math.ceil(width * scale) * math.ceil(height * scale) > max_pixels
                         or max(math.ceil(width * scale), math.ceil(height * scale)) > ocr.MAX_SIDE):
        scale *= 0.999  # the ceilings' extra pixel row and column
    return scale


def read_pdf(data: bytes, budget: Budget) -> Document:
    limits = budget.limits
    inflate_check(data, limits, budget=budget)
    pdf = open_pdf(data)
    try:
        if len(pdf) == 0:
            raise IngestError(422, "the PDF has no pages")
        check_pages(len(pdf), "the PDF", limits)
        pages, text_lines = [], []
        for index in range(len(pdf)):
            budget.check_time(f"the text of page {index + 1}")
            pages.append(pdf[index])
            text_lines.append(_lines(pages[-1], pages[-1].get_size()[1]))
        scanned = {i for i, (page, lines) in enumerate(zip(pages, text_lines)) if not lines and _draws(page)}
        check_ocr_pages(len(scanned), "the PDF", limits)
        scales = {i: _scan_scale(pages[i], i + 1, budget) for i in sorted(scanned)}
        rendered = 0
        for i, scale in scales.items():
            width, height = pages[i].get_size()
            rendered += math.ceil(width * scale) * math.ceil(height * scale)
        budget.take_pixels(rendered, f"the PDF's {len(scanned)} scanned pages, rendered for OCR,")
        doc = Document(text="", media_type=MEDIA_TYPE, source=data)
        parts: list[str] = []
        places: list[CharPlace | None] = []
        line_no = 0
        for index, (page, lines) in enumerate(zip(pages, text_lines)):
            width, height = page.get_size()
            doc.pages.append(Page(index + 1, width, height, ocr=index in scanned))
            if parts:  # a blank line between pages
                parts.append("\n\n")
                places += [None, None]
            if index in scanned:
                budget.check_time(f"rendering page {index + 1}")
                text, page_places = _read_scan(page, index + 1, line_no, scales[index], budget)
                parts.append(text)
                places += page_places
                line_no += text.count("\n") + 1
                continue
            for r, row in enumerate(rows(lines)):
                if r:
                    parts.append("\n")
                    places.append(None)
                for j, line in enumerate(row):
                    if j:
                        parts.append(" ")
                        places.append(None)
                    for ch, box in line.chars:
                        parts.append(ch)
                        places.append(CharPlace(index + 1, line_no, box) if box is not None else None)
                line_no += 1
        doc.text = "".join(parts)
        doc.chars = places
    finally:
        pdf.close()
    if not doc.text.strip():
        found = (f"the PDF has no text layer, and OCR found no text on its scanned pages ({len(scanned)})" if scanned
                 else "the PDF has no text layer, and its pages are blank")
        raise IngestError(422, found + "".join(f"; {warning}" for warning in budget.warnings), code="no_text_found")
    return doc


def _scan_scale(page, number: int, budget: Budget) -> float:
    """The scale page `number` (a scan) is rendered at for OCR, with a warning when it is under
    OCR_SCALE; IngestError(413) for an image on it over max_page_pixels, which PDFium would
    decode at its full size."""
    import pypdfium2.raw as raw

    limits = budget.limits
    width, height = page.get_size()
    if not (width > 0 and height > 0):
        raise IngestError(422, f"page {number} of the PDF has no area ({width:g} x {height:g} points)")
    for image in page.get_objects(filter=(raw.FPDF_PAGEOBJ_IMAGE,), max_depth=4):
        w, h = image.get_px_size()
        if w * h > limits.max_page_pixels:
            raise IngestError(413, f"page {number} of the PDF draws an image of {w} x {h} pixels ({w * h}); the limit "
                                   f"is {limits.max_page_pixels} pixels ({SETTINGS['max_page_pixels']})")
    scale = render_scale(width, height, limits.max_page_pixels)
    if scale < OCR_SCALE:
        why = (f"within {limits.max_page_pixels} pixels ({SETTINGS['max_page_pixels']})"
               if math.ceil(width * OCR_SCALE) * math.ceil(height * OCR_SCALE) > limits.max_page_pixels
               else f"each side within {ocr.MAX_SIDE} pixels (Tesseract's limit)")
        budget.warnings.append(f"page {number} is {width:g} x {height:g} points: rendered at {72 * scale:.0f} dpi "
                               f"instead of {72 * OCR_SCALE:.0f} to stay {why}")
    return scale


def _draws(page) -> bool:
    """Whether the page draws anything (an image, paths): a page without text that does is a scan."""
    import pypdfium2.raw as raw

    return raw.FPDFPage_CountObjects(page.raw) > 0


def _read_scan(page, number: int, first_line: int, scale: float, budget: Budget
               ) -> tuple[str, list[CharPlace | None]]:
    """A page without a text layer, rendered at `scale` and read by OCR: its text, and boxes in points."""
    import pypdfium2 as pdfium

    try:
        bitmap = page.render(scale=scale)
        image = bitmap.to_pil()
    except pdfium.PdfiumError as e:
        raise IngestError(422, f"page {number} of the PDF cannot be rendered: {e}") from None
    bitmap.close()  # its pixels are copied into `image`; one copy at a time
    del bitmap
    return ocr.page_text(ocr.find_lines(image, 72 * scale, budget, number), number, first_line, scale)


def _lines(page, height: float) -> list[_Line]:
    """The page's lines as PDFium splits them (at its generated line breaks)."""
    import pypdfium2.raw as raw

    textpage = page.get_textpage()
    try:
        lines: list[_Line] = []
        current: list[tuple[str, Box | None]] = []
        for i in range(textpage.count_chars()):
            code = raw.FPDFText_GetUnicode(textpage.raw, i)
            ch = chr(code) if code else ""
            if ch in ("\r", "\n"):
                _close(current, lines)
                current = []
                continue
            if not ch or (ord(ch) < 32 and ch != "\t") or ch in ("\ufffe", "\uffff"):
                continue  # control characters PDFium reports for hyphens and unmapped glyphs
            left, bottom, right, top = textpage.get_charbox(i)
            generated = raw.FPDFText_IsGenerated(textpage.raw, i) == 1
            box = None if generated or right <= left else (left, height - top, right, height - bottom)
            current.append((" " if ch == "\t" else ch, box))
        _close(current, lines)
        return lines
    finally:
        textpage.close()


def _close(chars, lines: list[_Line]) -> None:
    while chars and chars[-1][0] == " ":
        chars.pop()
    while chars and chars[0][0] == " ":
        chars.pop(0)
    boxes = [b for _, b in chars if b is not None]
    if boxes:
        lines.append(_Line(chars, min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[3] for b in boxes)))
