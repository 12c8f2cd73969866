"""A document as the engine sees it (text), with where each character sits on its page.

Ingestion turns bytes into a Document: `text` is what the model reads and what spans index;
`chars` maps each character of `text` to its page and box, or to nothing for the spaces and
line breaks ingestion put between lines and pages. Boxes are [x0, y0, x1, y1] in the page's
own units (PDF points, 1/72 inch, for a PDF; pixels for an image) measured from the page's
top-left corner, y downwards, as image pixels are.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

Box = tuple[float, float, float, float]


# The machine-readable `code` of every IngestError: (its HTTP status, what it means). The API
# and the docs' table read them from here.
FILE_ERRORS: dict[str, tuple[int, str]] = {
    "file_too_large": (413, "the file, or what reading it takes (pages, pixels, decompressed bytes), is over a "
                            "limit; the message names its setting"),
    "unsupported_media_type": (415, "not text, PDF, PNG, JPEG or TIFF"),
    "file_unreadable": (422, "the file is corrupt, truncated, or not what its type says"),
    "file_encrypted": (422, "a PDF that needs a password"),
    "no_text_found": (422, "no text: blank pages, or OCR read nothing"),
    "ocr_unavailable": (415, "an image or a scanned page, and the server has no OCR engine (Tesseract)"),
    "read_timeout": (422, "reading took longer than ingest_timeout_s, or OCR of one page longer than "
                          "ingest_ocr_page_timeout_s"),
    "read_memory": (413, "the process reading the file reached its memory limit (ingest_max_memory_mb)"),
    "read_crashed": (422, "the process reading the file (or its OCR) died"),
    "file_missing": (404, "an uploaded file (`file_id`) was deleted before a worker read it"),
}
STATUS_CODES = {413: "file_too_large", 415: "unsupported_media_type", 422: "file_unreadable"}  # the default code


class IngestError(ValueError):
    """A document that cannot be read: `status` is the HTTP status that names the kind of
    problem (413 too large, 415 unsupported media type, 422 unreadable content), `code` a
    stable machine-readable name for it (FILE_ERRORS; by default the status's)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code or STATUS_CODES.get(status, "file_unreadable")
        if self.code not in FILE_ERRORS:
            raise ValueError(f"unknown IngestError code {self.code!r}; add it to FILE_ERRORS")

    def __reduce__(self):  # pickled (a Celery result, a process boundary) with its status and code
        return type(self), (self.status, str(self), self.code)


@dataclass(frozen=True)
class Page:
    number: int  # 1-based
    width: float
    height: float
    unit: str = "pt"  # "pt" (PDF points) or "px" (image pixels)
    ocr: bool = False  # its text was read by OCR (an image, a PDF page without a text layer)


@dataclass(frozen=True)
class CharPlace:
    page: int  # 1-based page number
    line: int  # the line's index in the document: a value wrapping lines gets one box per line
    box: Box


@dataclass
class Document:
    text: str
    media_type: str
    pages: list[Page] = field(default_factory=list)
    chars: list[CharPlace | None] = field(default_factory=list)  # one per character of `text`, or empty
    source: bytes = field(default=b"", repr=False)  # the bytes it was read from, where it has pages
    # what the reader changed to stay within its limits (a page rendered at a lower resolution);
    # not stored with the layout
    warnings: list[str] = field(default_factory=list)

    @property
    def has_layout(self) -> bool:
        return bool(self.chars)

    def locate(self, start: int, end: int) -> list[dict]:
        """Where text[start:end] sits: one {"page", "box"} per line it covers (the union of its
        characters' boxes on that line), in text order; empty for plain text."""
        if not self.chars:
            return []
        groups: dict[tuple[int, int], list[float]] = {}
        for place in self.chars[max(start, 0):min(end, len(self.chars))]:
            if place is None:
                continue
            key = (place.page, place.line)
            x0, y0, x1, y1 = place.box
            if key not in groups:
                groups[key] = [x0, y0, x1, y1]
            else:
                g = groups[key]
                g[0], g[1], g[2], g[3] = min(g[0], x0), min(g[1], y0), max(g[2], x1), max(g[3], y1)
        return [{"page": page, "box": [round(v, 2) for v in box]} for (page, _), box in groups.items()]

    def locate_spans(self, spans: dict[str, list[int] | None] | None) -> dict[str, list[dict]]:
        """locate() for each span of a result ({pointer: [start, end], or None where the value
        was not found in the text}); pointers without a span or a box are left out."""
        if not spans or not self.chars:
            return {}
        located = {pointer: self.locate(*span) for pointer, span in spans.items() if span is not None}
        return {pointer: places for pointer, places in located.items() if places}


# --- reading order, shared by the formats -----------------------------------------------------

class Placed(Protocol):
    x0: float  # left edge
    y0: float  # top
    y1: float  # bottom


L = TypeVar("L", bound=Placed)


def rows(lines: list[L]) -> list[list[L]]:
    """Lines grouped into rows (their vertical middles within half the smaller height of each
    other), top to bottom, each row left to right."""
    out: list[list[L]] = []
    for line in sorted(lines, key=lambda ln: ((ln.y0 + ln.y1) / 2, ln.x0)):
        mid, h = (line.y0 + line.y1) / 2, line.y1 - line.y0
        if out:
            last = out[-1]
            last_mid = sum((ln.y0 + ln.y1) / 2 for ln in last) / len(last)
            last_h = min(ln.y1 - ln.y0 for ln in last)
            if abs(mid - last_mid) <= max(min(h, last_h), 1.0) / 2:
                last.append(line)
                continue
        out.append([line])
    return [sorted(row, key=lambda ln: ln.x0) for row in out]


# --- stored with a job: the layout without the text (the job stores that) ---------------------

LAYOUT_VERSION = 1


def encode_layout(doc: Document) -> bytes | None:
    """`doc`'s pages and character places as compact zlib-compressed JSON, or None for plain
    text. Characters without a place are 0; boxes keep two decimals (1/7200 inch)."""
    if not doc.chars:
        return None
    chars = [0 if p is None else [p.page, p.line, *(round(v, 2) for v in p.box)] for p in doc.chars]
    body = {"v": LAYOUT_VERSION, "media_type": doc.media_type,
            "pages": [[p.number, round(p.width, 2), round(p.height, 2), p.unit, *([1] if p.ocr else [])]
                      for p in doc.pages], "chars": chars}
    return zlib.compress(json.dumps(body, separators=(",", ":")).encode(), 6)


def decode_layout(text: str, blob: bytes) -> Document:
    """The Document that encode_layout() stored, with its text given back."""
    body = json.loads(zlib.decompress(blob))
    if body.get("v") != LAYOUT_VERSION:
        raise ValueError(f"unknown layout version {body.get('v')!r}")
    pages = [Page(*p[:4], ocr=len(p) > 4 and bool(p[4])) for p in body["pages"]]
    chars = [None if c == 0 else CharPlace(c[0], c[1], tuple(c[2:6])) for c in body["chars"]]
    if len(chars) != len(text):
        raise ValueError(f"layout of {len(chars)} characters for a text of {len(text)}")
    return Document(text=text, media_type=body["media_type"], pages=pages, chars=chars)
