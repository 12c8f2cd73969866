"""What reading one document may cost: `Limits` (one per deployment, from Settings) and
`Budget` (what one reading has spent so far, checked by every decoder as it goes).

Each limit is a setting (structspec/config.py); every refusal names it. The defaults here are
Settings' defaults (a test holds them equal).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

from structspec.ingest.document import IngestError

MIB = 1024 * 1024

# the setting behind each field, named by every error about it
SETTINGS = {
    "max_bytes": "max_file_bytes",
    "max_pages": "ingest_max_pages",
    "max_ocr_pages": "ingest_max_ocr_pages",
    "max_page_pixels": "ingest_max_page_pixels",
    "max_document_pixels": "ingest_max_document_pixels",
    "ocr_page_timeout_s": "ingest_ocr_page_timeout_s",
    "timeout_s": "ingest_timeout_s",
    "max_decompressed_bytes": "ingest_max_decompressed_mb",
    "max_memory_bytes": "ingest_max_memory_mb",
}


@dataclass(frozen=True)
class Limits:
    max_bytes: int | None = 50 * MIB  # the file; None: no limit
    max_pages: int = 200  # PDF pages, TIFF frames
    max_ocr_pages: int = 20  # pages read by OCR
    max_page_pixels: int = 50_000_000  # one decoded image frame or rendered page
    max_document_pixels: int = 300_000_000  # every decoded frame and rendered page of the document
    ocr_page_timeout_s: float = 60  # OCR of one page
    timeout_s: float = 240  # the whole document
    max_decompressed_bytes: int = 512 * MIB  # a PDF's Flate streams, inflated
    max_memory_bytes: int = 1024 * MIB  # the isolated reading process (read_isolated), above its start

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_bytes":
                continue
            zero_ok = f.name == "max_ocr_pages"  # 0: only text layers are read
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or value < 0 or (value == 0 and not zero_ok):
                raise ValueError(f"Limits.{f.name} ({SETTINGS[f.name]}) must be a number over 0"
                                 f"{' (or 0)' if zero_ok else ''}, not {value!r}")

    @classmethod
    def from_settings(cls, settings) -> Limits:
        """The limits of structspec.config.Settings (the `ingest_*` fields and max_file_bytes)."""
        return cls(max_bytes=settings.max_file_bytes, max_pages=settings.ingest_max_pages,
                   max_ocr_pages=settings.ingest_max_ocr_pages, max_page_pixels=settings.ingest_max_page_pixels,
                   max_document_pixels=settings.ingest_max_document_pixels,
                   ocr_page_timeout_s=settings.ingest_ocr_page_timeout_s, timeout_s=settings.ingest_timeout_s,
                   max_decompressed_bytes=settings.ingest_max_decompressed_mb * MIB,
                   max_memory_bytes=settings.ingest_max_memory_mb * MIB)


def check_size(data: bytes, limits: Limits) -> None:
    if limits.max_bytes is not None and len(data) > limits.max_bytes:
        raise IngestError(413, f"the file is {len(data)} bytes; the limit is {limits.max_bytes} bytes "
                               f"({SETTINGS['max_bytes']})")


def check_pages(count: int, what: str, limits: Limits, at_least: bool = False) -> None:
    """`what` ("the PDF", "the image") has `count` pages (`at_least`: counting stopped there):
    no more than max_pages."""
    if count > limits.max_pages:
        raise IngestError(413, f"{what} has {'at least ' * at_least}{count} pages; the limit is {limits.max_pages} "
                               f"pages ({SETTINGS['max_pages']})")


def check_ocr_pages(count: int, what: str, limits: Limits, at_least: bool = False) -> None:
    """`what` has `count` pages to read by OCR: no more than max_ocr_pages."""
    if count > limits.max_ocr_pages:
        raise IngestError(413, f"{what} has {'at least ' * at_least}{count} pages to read by OCR; the limit is "
                               f"{limits.max_ocr_pages} pages ({SETTINGS['max_ocr_pages']})")


@dataclass
class Budget:
    """One reading's spending against its Limits: the time since it started (checked between
    pages, and bounding each OCR run), the pixels decoded or rendered, and the warnings to
    give with the document."""

    limits: Limits
    start: float = field(default_factory=time.monotonic)
    pixels: int = 0
    warnings: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def check_time(self, where: str) -> None:
        """IngestError(read_timeout) once the document has taken longer than timeout_s; `where`
        says what was next ("page 3")."""
        elapsed = self.elapsed()
        if elapsed > self.limits.timeout_s:
            raise IngestError(422, f"reading the document took longer than its limit of {self.limits.timeout_s:g} s "
                                   f"({SETTINGS['timeout_s']}): stopped after {elapsed:.3g} s, before {where}",
                              code="read_timeout")

    def ocr_timeout(self, page: int) -> tuple[float, str]:
        """(seconds, the setting that sets them) one OCR run of `page` may take: the per-page
        limit, or what is left of the document's time when that is less."""
        self.check_time(f"OCR of page {page}")
        left = self.limits.timeout_s - self.elapsed()
        if self.limits.ocr_page_timeout_s <= left:
            return self.limits.ocr_page_timeout_s, SETTINGS["ocr_page_timeout_s"]
        return max(left, 0.0), SETTINGS["timeout_s"]

    def take_pixels(self, pixels: int, what: str) -> None:
        """Count `pixels` more decoded or rendered (`what`: which pages, as the subject of
        "take the document to N pixels"); IngestError(413) when the document's total goes over
        max_document_pixels. Called before they are decoded."""
        self.pixels += pixels
        check_document_pixels(self.pixels, what, self.limits)


def check_page_pixels(width: int, height: int, what: str, limits: Limits) -> None:
    """IngestError(413) for an image frame over max_page_pixels (an image is refused; a PDF page
    is rendered at a lower resolution instead, pdf.py)."""
    if width * height > limits.max_page_pixels:
        raise IngestError(413, f"{what} is {width} x {height} pixels ({width * height}); the limit is "
                               f"{limits.max_page_pixels} pixels ({SETTINGS['max_page_pixels']})")


def check_document_pixels(total: int, what: str, limits: Limits) -> None:
    if total > limits.max_document_pixels:
        raise IngestError(413, f"{what} take the document to {total} pixels decoded or rendered; the limit is "
                               f"{limits.max_document_pixels} pixels ({SETTINGS['max_document_pixels']})")
