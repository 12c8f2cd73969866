"""Ingestion: a document's bytes in, the text the model reads out, with each character's
page and box where the format has pages (document.py: Document).

One function, `ingest`, below the API, the CLI and the worker; one small module per format
(pdf.py, image.py), and ocr.py for what has no text layer (images, scanned PDF pages).
Formats are recognised by their magic bytes first, then the media type or file name given
with them.
"""

from __future__ import annotations

from pathlib import PurePath

from structspec.ingest import ocr
from structspec.ingest.document import CharPlace, Document, IngestError, Page, decode_layout, encode_layout
from structspec.ingest.image import read_image
from structspec.ingest.pdf import MEDIA_TYPE as PDF
from structspec.ingest.pdf import read_pdf

__all__ = ["CharPlace", "Document", "IngestError", "MEDIA_TYPES", "Page", "decode_layout", "detect", "encode_layout",
           "ingest"]

TEXT = "text/plain"
IMAGES = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff", "image/tiff": (b"II*\x00", b"MM\x00*")}
MEDIA_TYPES: tuple[str, ...] = (TEXT, PDF, *IMAGES)  # what ingest() reads
EXTENSIONS = {".txt": TEXT, ".text": TEXT, ".md": TEXT, ".pdf": PDF, ".png": "image/png", ".jpg": "image/jpeg",
              ".jpeg": "image/jpeg", ".tif": "image/tiff", ".tiff": "image/tiff"}
MAX_PAGES = 200


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


def ingest(data: bytes, media_type: str | None = None, name: str | None = None, *,
           max_bytes: int | None = None, max_pages: int = MAX_PAGES, max_ocr_pages: int = ocr.MAX_PAGES) -> Document:
    """`data` as a Document; IngestError naming the problem (its status: 413, 415 or 422).
    Images, and PDF pages without a text layer, are read by OCR, at most `max_ocr_pages` of them."""
    if max_bytes is not None and len(data) > max_bytes:
        raise IngestError(413, f"the document is {len(data)} bytes; the limit is {max_bytes} bytes "
                               "(max_document_bytes)")
    kind = detect(data, media_type, name)
    if kind == PDF:
        return read_pdf(data, max_pages, max_ocr_pages)
    if kind in IMAGES:
        return read_image(data, kind, name, max_pages, max_ocr_pages)
    if kind != TEXT and not kind.startswith("text/"):
        raise IngestError(415, f"unsupported media type {kind}; send one of {', '.join(MEDIA_TYPES)}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IngestError(422, f"the document is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
    if "\x00" in text:
        raise IngestError(422, "the document holds NUL characters: not text")
    return Document(text=text, media_type=TEXT)
