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
"""

from __future__ import annotations

from dataclasses import dataclass

from structspec.ingest import ocr
from structspec.ingest.document import Box, CharPlace, Document, IngestError, Page, rows

MEDIA_TYPE = "application/pdf"
# pixels per point when a page without a text layer is rendered for OCR (216 dpi): Tesseract kept
# 0.96-0.97 of two invoices' words at 3, 0.87-0.96 at 2, and no more at 4.17 (300 dpi), 15% slower
OCR_SCALE = 3.0


@dataclass
class _Line:
    chars: list[tuple[str, Box | None]]  # (character, its box from the page's top-left corner)
    x0: float
    y0: float
    y1: float


def read_pdf(data: bytes, max_pages: int, max_ocr_pages: int = ocr.MAX_PAGES) -> Document:
    import pypdfium2 as pdfium

    try:
        pdf = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as e:
        if "password" in str(e).lower():
            raise IngestError(422, "the PDF is encrypted (it needs a password); send it decrypted") from None
        raise IngestError(422, f"the PDF cannot be read: {str(e).rstrip('.')} (corrupt or not a PDF)") from None
    try:
        if len(pdf) == 0:
            raise IngestError(422, "the PDF has no pages")
        if len(pdf) > max_pages:
            raise IngestError(413, f"the PDF has {len(pdf)} pages; the limit is {max_pages} pages")
        pages = [pdf[index] for index in range(len(pdf))]
        text_lines = [_lines(page, page.get_size()[1]) for page in pages]
        scanned = {i for i, (page, lines) in enumerate(zip(pages, text_lines)) if not lines and _draws(page)}
        if len(scanned) > max_ocr_pages:
            raise IngestError(413, f"the PDF has {len(scanned)} pages without a text layer, to read by OCR; "
                                   f"the limit is {max_ocr_pages} pages")
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
                text, page_places = _read_scan(page, index + 1, line_no)
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
        raise IngestError(422, f"the PDF has no text layer, and OCR found no text on its scanned pages ({len(scanned)})"
                               if scanned else "the PDF has no text layer, and its pages are blank")
    return doc


def _draws(page) -> bool:
    """Whether the page draws anything (an image, paths): a page without text that does is a scan."""
    import pypdfium2.raw as raw

    return raw.FPDFPage_CountObjects(page.raw) > 0


def _read_scan(page, number: int, first_line: int) -> tuple[str, list[CharPlace | None]]:
    """A page without a text layer, rendered and read by OCR: its text, and boxes in points."""
    image = page.render(scale=OCR_SCALE).to_pil()
    return ocr.page_text(ocr.find_lines(image, dpi=72 * OCR_SCALE), number, first_line, OCR_SCALE)


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
