"""OCR: the words of a page image with their boxes, laid out as a page of a Document.

The engine is Tesseract 5, run as the `tesseract` command, one single-threaded process per
page (its English model loads in ~0.1 s of the 1-2 s an invoice page takes on this 2-core CPU). It is a
system package, not a wheel: Debian's `tesseract-ocr` (which brings the English model,
`tesseract-ocr-eng`); `make install` cannot install it and says so. Without it, images and
scanned PDF pages are refused (415, ocr_unavailable) naming the package. What is kept per
process is the checked path of the command (engine()); the model loads with each page's process.

Each run is bounded by the reading's Budget (limits.py): its time by ingest_ocr_page_timeout_s,
or by what is left of ingest_timeout_s when that is less (then it is killed: 422
read_timeout); the image it is given by ingest_max_page_pixels, enlargement included. Its
memory is the reading process's to bound: under read_isolated the command inherits that
process's address-space limit, and a run that fails for want of memory is 413 read_memory.

It was picked over rapidocr-onnxruntime 1.4.4 (PaddleOCR's PP-OCRv4 models on onnxruntime,
a pip wheel) on the invoices of ../shared/data (bench/ocr.py, docs/benchmarks.md):
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
import errno
import functools
import io
import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from structspec.ingest.document import Box, CharPlace, IngestError, rows
from structspec.ingest.limits import MIB, SETTINGS, Budget, Limits

if TYPE_CHECKING:
    from PIL.Image import Image

LANGUAGE = "eng"
# One OpenMP thread: Tesseract's threads spin while they wait, and beside other work on this
# 2-core CPU a page took 2.9 s with its default threads against 0.7 s with one. Concurrent
# requests then OCR side by side, a core each.
ENV = {**os.environ, "OMP_THREAD_LIMIT": "1"}
MAX_SIDE = 32767  # Tesseract 5 refuses an image wider or taller ("Image too large")
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
                               f"installed here; {INSTALL}", code="ocr_unavailable")
    try:
        langs = subprocess.run([exe, "--list-langs"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise IngestError(415, f"the tesseract command ({exe}) does not run here: {e}", code="ocr_unavailable") \
            from None
    if LANGUAGE not in langs.stdout.split():
        raise IngestError(415, f"tesseract has no {LANGUAGE!r} model here ({langs.stdout.strip()!r}); "
                               "install it (Debian: apt-get install tesseract-ocr-eng)", code="ocr_unavailable")
    return exe


# what Tesseract 5.3 and its image library print when an allocation fails: Leptonica's
# "pixd not made" (seen under an address-space limit), a C++ std::bad_alloc
OUT_OF_MEMORY = ("not made", "bad_alloc", "out of memory", "Cannot allocate")


def find_lines(image: Image, dpi: float | None = None, budget: Budget | None = None, page: int = 1) -> list[Line]:
    """The text lines OCR reads in `image`, boxes in its pixels; empty when it finds none.
    `dpi`: the image's resolution, where known (Tesseract estimates it otherwise). `budget`:
    the reading's limits and time so far (a fresh default one if not given); `page` names the
    page in errors."""
    from PIL import Image

    budget = budget or Budget(Limits())
    exe = engine()
    # in colour: Tesseract's own grey conversion keeps text that Pillow's luma turns to the
    # grey of its background (an invoice here lost its coloured table rows)
    rgb = image if image.mode == "RGB" else image.convert("RGB")  # convert() would copy an RGB image
    k = enlargement(rgb, dpi, budget.limits.max_page_pixels)
    if max(rgb.size) > MAX_SIDE:
        k = MAX_SIDE / max(rgb.size)
        budget.warnings.append(f"page {page} is {rgb.width} x {rgb.height} pixels: read by OCR at {k:.0%} of its "
                               f"size, as Tesseract reads no side over {MAX_SIDE} pixels")
    if k != 1:
        rgb = rgb.resize((max(1, math.floor(rgb.width * k)), max(1, math.floor(rgb.height * k))),
                         Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    rgb.save(buf, "PPM")  # uncompressed: nothing to encode or decode
    del rgb
    cmd = [exe, "stdin", "stdout", "-l", LANGUAGE, *(["--dpi", str(round(dpi * k))] if dpi else []), "tsv"]
    timeout, setting = budget.ocr_timeout(page)
    try:
        # the buffer itself, not a copy of it (a 50-megapixel page is 150 MB)
        out = subprocess.run(cmd, input=buf.getbuffer(), capture_output=True, timeout=timeout, env=ENV)
    except subprocess.TimeoutExpired:
        if setting == SETTINGS["timeout_s"]:
            raise IngestError(422, f"OCR of page {page} was stopped after {timeout:.3g} s, when reading the document "
                                   f"reached its limit of {budget.limits.timeout_s:g} s ({setting})",
                              code="read_timeout") from None
        raise IngestError(422, f"OCR of page {page} took longer than its limit of {timeout:g} s ({setting})",
                          code="read_timeout") from None
    except OSError as e:
        if e.errno == errno.ENOMEM:  # no memory left to start it, under the reading process's limit
            raise IngestError(413, f"OCR of page {page} could not start: {e}", code="read_memory") from None
        raise IngestError(415, f"OCR of page {page} could not start: {e}", code="ocr_unavailable") from None
    if out.returncode != 0:
        err = out.stderr.decode(errors="replace").strip()
        last = err.splitlines()[-1][-300:] if err else "nothing on stderr"
        how = f"signal {-out.returncode}" if out.returncode < 0 else f"status {out.returncode}"
        if any(sign in err for sign in OUT_OF_MEMORY):
            raise IngestError(413, f"OCR of page {page} ran out of memory (tesseract exited with {how}: {last}); "
                                   f"the reading process's limit is {budget.limits.max_memory_bytes // MIB} MiB "
                                   f"({SETTINGS['max_memory_bytes']})", code="read_memory")
        raise IngestError(422, f"OCR of page {page} failed: tesseract exited with {how}: {last}", code="read_crashed")
    return parse_tsv(out.stdout.decode("utf-8", "replace"), k)


def enlargement(image: Image, dpi: float | None, max_pixels: int) -> float:
    """2 for a low-resolution image (under 150 dpi, or without a resolution and narrower than
    an A4 page at 150 dpi), else 1; 1 too when the enlarged image would be over `max_pixels`
    (ingest_max_page_pixels). Tesseract reads small print better enlarged: a 96-dpi invoice
    here went from 0.76 to 0.93 of its OCR words right."""
    low = dpi < 150 if dpi else image.width < 1240
    return 2.0 if low and 4 * image.width * image.height <= max_pixels else 1.0


def parse_tsv(tsv: str, k: float = 1) -> list[Line]:
    """Tesseract's TSV (one row per page, block, paragraph, line and word) as lines of words,
    boxes divided by `k` (the image was resized k times)."""
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
