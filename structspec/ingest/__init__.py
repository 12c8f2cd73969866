"""Ingestion: a document's bytes in, the text the model reads out, with each character's
page and box where the format has pages (document.py: Document).

Below the API, the CLI and the worker; one small module per format
(pdf.py, image.py), and ocr.py for what has no text layer (images, scanned PDF pages).
Formats are recognised by their magic bytes first, then the media type or file name given
with them.

Every reading has a budget (limits.py: Limits, from Settings' `ingest_*` settings and
max_file_bytes): pages, OCR pages, pixels per page and per document, decompressed bytes, time
per OCR page and per document. A file over one is refused with IngestError naming the setting.
Three entry points:
- probe(): the checks that take milliseconds whatever the file (size, format, that it opens,
  page count, image sizes from their headers), for the API while the request waits;
- ingest(): the whole reading, in this process;
- read_isolated() (isolated.py): ingest() in a separate process with a memory limit and a
  wall clock, for the worker: a hostile file cannot take the caller down.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

from structspec.ingest.document import FILE_ERRORS, CharPlace, Document, IngestError, Page, decode_layout, \
    encode_layout
from structspec.ingest.image import headers, read_image
from structspec.ingest.limits import Budget, Limits, check_size
from structspec.ingest.pdf import MEDIA_TYPE as PDF
from structspec.ingest.pdf import probe_pdf, read_pdf

__all__ = ["CharPlace", "Document", "FILE_ERRORS", "IngestError", "Limits", "MEDIA_TYPES", "Page", "Probe",
           "decode_layout", "detect", "encode_layout", "ingest", "probe", "read_isolated"]

TEXT = "text/plain"
IMAGES = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff", "image/tiff": (b"II*\x00", b"MM\x00*")}
MEDIA_TYPES: tuple[str, ...] = (TEXT, PDF, *IMAGES)  # what ingest() reads
EXTENSIONS = {".txt": TEXT, ".text": TEXT, ".md": TEXT, ".pdf": PDF, ".png": "image/png", ".jpg": "image/jpeg",
              ".jpeg": "image/jpeg", ".tif": "image/tiff", ".tiff": "image/tiff"}


@dataclass(frozen=True)
class Probe:
    media_type: str  # the Document's media type ingest() would give
    pages: int  # PDF pages, image frames; 1 for text


def detect(data: bytes, media_type: str | None = None, name: str | None = None) -> str:
    """The document's media type: its magic bytes, else the media type given, else the file
    name's extension, else text."""
    if data.startswith(b"%PDF-"):
        return PDF
    for kind, magic in IMAGES.items():
        if data.startswith(magic):
            return kind
    if media_type:
        return media_type.split(";", 1)[0].strip().lower()
    if name:
        return EXTENSIONS.get(PurePath(name).suffix.lower(), TEXT)
    return TEXT


def probe(data: bytes, media_type: str | None = None, name: str | None = None, *,
          limits: Limits = Limits()) -> Probe:
    """The checks that need no rendering, OCR or full decoding, in milliseconds on any file:
    the size (max_bytes), the format (415 for one not read), that it opens (a PDF: its
    structure's Flate streams counted, then PDFium opens it in a separate process bounded in
    time and memory; an image: its headers, by Pillow's format plugin), its pages against
    max_pages, and an image's frames against max_ocr_pages, max_page_pixels and
    max_document_pixels; text: UTF-8 without NUL. IngestError as ingest() raises it; what
    passes may still be refused by ingest()."""
    check_size(data, limits)
    kind = detect(data, media_type, name)
    if kind == PDF:
        return Probe(kind, probe_pdf(data, limits))
    if kind in IMAGES:
        return Probe(kind, len(headers(data, kind, limits)))
    _text(data, kind)
    return Probe(TEXT, 1)


def ingest(data: bytes, media_type: str | None = None, name: str | None = None, *,
           limits: Limits = Limits()) -> Document:
    """`data` as a Document; IngestError naming the problem (its status: 413, 415 or 422, and
    its code), and the setting where a limit refused it. Images, and PDF pages without a text
    layer, are read by OCR. What the reading changed to stay within a limit (a page rendered at
    a lower resolution) is in the Document's warnings."""
    check_size(data, limits)
    budget = Budget(limits)
    kind = detect(data, media_type, name)
    try:
        if kind == PDF:
            doc = read_pdf(data, budget)
        elif kind in IMAGES:
            doc = read_image(data, kind, name, budget)
        else:
            return Document(text=_text(data, kind), media_type=TEXT)
    except MemoryError:
        raise IngestError(413, "reading the file ran out of memory", code="read_memory") from None
    doc.warnings = budget.warnings
    return doc


def _text(data: bytes, kind: str) -> str:
    if kind != TEXT and not kind.startswith("text/"):
        raise IngestError(415, f"unsupported media type {kind}; send one of {', '.join(MEDIA_TYPES)}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IngestError(422, f"the document is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
    if "\x00" in text:
        raise IngestError(422, "the document holds NUL characters: not text")
    return text


def read_isolated(data: bytes, media_type: str | None = None, name: str | None = None, *,
                  limits: Limits) -> Document:
    """ingest() in a separate process, its memory and time bounded (isolated.py)."""
    from structspec.ingest import isolated

    return isolated.read_isolated(data, media_type, name, limits=limits)
