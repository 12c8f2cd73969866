"""OCR: the words of a page image with their boxes, laid out as a page of a Document.

The engine is Tesseract 5, run as the `tesseract` command, one single-threaded process per
page (its English model loads in ~0.1 s of the 1-2 s an invoice page takes on this 2-core CPU). It is a
system package, not a wheel: Debian's `tesseract-ocr` (which brings the English model,
`tesseract-ocr-eng`); `make install` cannot install it and says so. Without it, images and
scanned PDF pages are refused (415) naming the package. What is kept per process is the
checked path of the command (engine()); the model loads with each page's process.

It was picked over rapidocr-onnxruntime 1.4.4 (PaddleOCR's PP-OCRv4 models on onnxruntime,
a pip wheel) on the invoices of ../shared/data (structspec/bench/ocr.py, docs/benchmarks.md):
rapidocr's recogniser runs English words together ("OfficeChair"), so it kept 0.47 of the
text layer's words to Tesseract's 0.94, and 120 of 134 expected field values to 133, in
4.2 s a page to 1.5 (one thread each).

Tesseract gives a box per word. Each character gets a slice of its word's box proportional
to its position in the word: the box cut into as many equal columns as the word has
characters, character i taking column i, at the word's full height. That is exact for
monospaced text and off by a fraction of a character for proportional fonts; a value's box
(the union of its characters') is exact wherever the value starts and ends at word edges.
The spaces put between words have no box, as a PDF's generated spaces have none.
"""

from __future__ import annotations

import csv
import functools
import io
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from structspec.ingest.document import Box, CharPlace, IngestError, rows

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_PAGES = 20  # pages read by OCR per document: it runs while the request waits, ~30 s for 20 here
TIMEOUT_S = 120  # one page; an invoice page takes 1-3 s here
LANGUAGE = "eng"
# One OpenMP thread: Tesseract's threads spin while they wait, and beside other work on this
# 2-core CPU a page took 2.9 s with its default threads against 0.7 s with one. Concurrent
# requests then OCR side by side, a core each.
ENV = {**os.environ, "OMP_THREAD_LIMIT": "1"}
ENLARGED_MAX_PIXELS = 50_000_000  # an image is enlarged only while it stays under this
INSTALL = "install Tesseract (Debian: apt-get install tesseract-ocr)"


@dataclass(frozen=True)
class Word:
    text: str
    box: Box  # in the image's pixels
    confidence: float  # Tesseract's, 0-100


@dataclass(frozen=True)
class Line:
    words: list[Word]
    x0: float  # the union of its words' boxes
    y0: float
    x1: float
    y1: float


@functools.cache
def engine() -> str:
    """The `tesseract` executable, checked once per process: found, and with the English model."""
    exe = shutil.which("tesseract")
    if exe is None:
        raise IngestError(415, f"images and scanned PDF pages need OCR, and the tesseract command is not "
                               f"installed here; {INSTALL}")
    langs = subprocess.run([exe, "--list-langs"], capture_output=True, text=True, timeout=30)
    if LANGUAGE not in langs.stdout.split():
        raise IngestError(415, f"tesseract has no {LANGUAGE!r} model here ({langs.stdout.strip()!r}); "
                               "install it (Debian: apt-get install tesseract-ocr-eng)")
    return exe


def find_lines(image: Image, dpi: float | None = None) -> list[Line]:
    """The text lines OCR reads in `image`, boxes in its pixels; empty when it finds none.
    `dpi`: the image's resolution, where known (Tesseract estimates it otherwise)."""
    from PIL import Image

    exe = engine()
    # in colour: Tesseract's own grey conversion keeps text that Pillow's luma turns to the
    # grey of its background (an invoice here lost its coloured table rows)
    rgb = image.convert("RGB")
    k = enlargement(image, dpi)
    if k > 1:
        rgb = rgb.resize((rgb.width * k, rgb.height * k), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    rgb.save(buf, "PPM")  # uncompressed: nothing to encode or decode
    cmd = [exe, "stdin", "stdout", "-l", LANGUAGE, *(["--dpi", str(round(dpi * k))] if dpi else []), "tsv"]
    try:
        out = subprocess.run(cmd, input=buf.getvalue(), capture_output=True, timeout=TIMEOUT_S, env=ENV)
    except subprocess.TimeoutExpired:
        raise IngestError(422, f"OCR gave up on a page after {TIMEOUT_S} s") from None
    if out.returncode != 0:
        raise RuntimeError(f"tesseract failed (exit {out.returncode}): {out.stderr.decode(errors='replace')[-500:]}")
    return parse_tsv(out.stdout.decode("utf-8", "replace"), k)


def enlargement(image: Image, dpi: float | None) -> int:
    """2 for a low-resolution image (under 150 dpi, or without a resolution and narrower than
    an A4 page at 150 dpi), else 1. Tesseract reads small print better enlarged: a 96-dpi
    invoice here went from 0.76 to 0.93 of its OCR words right."""
    low = dpi < 150 if dpi else image.width < 1240
    return 2 if low and 4 * image.width * image.height <= ENLARGED_MAX_PIXELS else 1


def parse_tsv(tsv: str, k: int = 1) -> list[Line]:
    """Tesseract's TSV (one row per page, block, paragraph, line and word) as lines of words,
    boxes divided by `k` (the image was enlarged k times)."""
    lines: dict[tuple[str, str, str], list[Word]] = {}
    for row in csv.DictReader(io.StringIO(tsv), delimiter="\t", quoting=csv.QUOTE_NONE):
        text = (row.get("text") or "").strip()
        if row["level"] != "5" or not text:
            continue
        left, top, width, height = (float(row[c]) / k for c in ("left", "top", "width", "height"))
        key = (row["block_num"], row["par_num"], row["line_num"])
        lines.setdefault(key, []).append(Word(text, (left, top, left + width, top + height), float(row["conf"])))
    return [Line(words, min(w.box[0] for w in words), min(w.box[1] for w in words),
                 max(w.box[2] for w in words), max(w.box[3] for w in words)) for words in lines.values()]


def page_text(lines: list[Line], page: int, first_line: int, scale: float = 1.0) -> tuple[str, list[CharPlace | None]]:
    """The page's text: its lines in reading order (rows top to bottom, each row left to right),
    one text line per OCR line, words joined by a space; and a place per character (None for
    the spaces and line breaks put between words and lines), boxes divided by `scale` (the
    image's pixels per page unit). Line numbers count from `first_line`."""
    parts: list[str] = []
    places: list[CharPlace | None] = []
    ordered = [line for row in rows(lines) for line in row]
    for n, line in enumerate(ordered):
        if n:
            parts.append("\n")
            places.append(None)
        for j, word in enumerate(line.words):
            if j:
                parts.append(" ")
                places.append(None)
            x0, y0, x1, y1 = (v / scale for v in word.box)
            step = (x1 - x0) / len(word.text)
            parts.append(word.text)
            places += [CharPlace(page, first_line + n, (x0 + i * step, y0, x0 + (i + 1) * step, y1))
                       for i in range(len(word.text))]
    return "".join(parts), places
