"""Images (PNG, JPEG, TIFF): each frame a page, its text read by OCR (ocr.py), every
character's box in the image's pixels (unit "px"), from the top-left corner of the image as
it is displayed (a JPEG's EXIF orientation applied).

Budgets (limits.py): the frames' sizes are read from their headers before any is decoded
(headers(): Pillow's format plugin, opened directly, reads them and nothing else; a TIFF's
frames are counted only up to the limit), and an image is refused (413) with a frame over
ingest_max_page_pixels, more frames than ingest_max_pages or ingest_max_ocr_pages, or frames
over ingest_max_document_pixels together. Pillow's own guard against decompression bombs
(Image.open refuses over 2 x Image.MAX_IMAGE_PIXELS, a process-wide setting) is bypassed so
that those settings are the only limit and the errors name them.
"""

from __future__ import annotations

import contextlib
import io
import struct
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from structspec.ingest.document import CharPlace, Document, IngestError, Page
from structspec.ingest.limits import Budget, Limits, check_document_pixels, check_ocr_pages, check_page_pixels, \
    check_pages
from structspec.ingest.ocr import find_lines, page_text

if TYPE_CHECKING:
    from PIL.Image import Image

# chunks, segments or tags before an image's pixels: a PNG has about 10 chunks there, a JPEG
# 5-50 segments (an ICC profile split in 64 KB pieces), a TIFF frame 10-40 tags
MAX_PARTS = 1000
# what Pillow raises for a corrupt or truncated file, besides its own UnidentifiedImageError
UNREADABLE = (OSError, SyntaxError, ValueError, EOFError, zlib.error, struct.error, IndexError, TypeError, KeyError)


def read_image(data: bytes, kind: str, name: str | None, budget: Budget) -> Document:
    sizes = headers(data, kind, budget.limits)
    budget.take_pixels(sum(w * h for w, h in sizes), _frames_phrase(len(sizes)))  # checked by headers(); counted
    doc = Document(text="", media_type=kind, source=data)
    parts: list[str] = []
    places: list[CharPlace | None] = []
    line_no = 0
    for number, (frame, dpi) in enumerate(_decode(data, kind, len(sizes)), start=1):
        doc.pages.append(Page(number, frame.width, frame.height, unit="px", ocr=True))
        text, page_places = page_text(find_lines(frame, dpi, budget, number), number, line_no)
        del frame
        if number < len(sizes):
            budget.check_time(f"page {number + 1}")
        if not text:
            continue
        if parts:  # a blank line between pages, as in a PDF
            parts.append("\n\n")
            places += [None, None]
        parts.append(text)
        places += page_places
        line_no += text.count("\n") + 1
    if not parts:
        raise IngestError(422, f"no text found in the image{f' {name}' if name else ''} (OCR read nothing)"
                               + "".join(f"; {warning}" for warning in budget.warnings), code="no_text_found")
    doc.text = "".join(parts)
    doc.chars = places
    return doc


def _frames_phrase(count: int) -> str:
    return "the image" if count == 1 else f"the image's {count} frames"


def _open(data: bytes, kind: str):
    """The image's first frame, its header read and nothing decoded, by the plugin of `kind`
    (not Image.open: see the module's docstring)."""
    from PIL import JpegImagePlugin, PngImagePlugin, TiffImagePlugin

    plugin = {"image/png": PngImagePlugin.PngImageFile, "image/jpeg": JpegImagePlugin.JpegImageFile,
              "image/tiff": TiffImagePlugin.TiffImageFile}[kind]
    return plugin(io.BytesIO(data))


def headers(data: bytes, kind: str, limits: Limits) -> list[tuple[int, int]]:
    """Each frame's (width, height) from the image's headers, nothing decoded; IngestError
    (413) over a limit (pages, OCR pages, a frame's pixels, all frames' pixels), 422 for a
    file that cannot be read."""
    most = min(limits.max_pages, limits.max_ocr_pages)  # every frame is read by OCR
    _check_layout(data, kind, most + 1)
    with _unreadable(kind):
        image = _open(data, kind)
        sizes = [image.size]
        more = False  # frames after those counted
        if image.format == "TIFF":  # each frame a page; counted one past the limit at most
            while len(sizes) <= most:
                try:
                    image.seek(len(sizes))
                except EOFError:
                    break
                sizes.append(image.size)
            if len(sizes) > most:
                try:
                    image.seek(len(sizes))
                    more = True
                except EOFError:
                    pass
    check_pages(len(sizes), "the image", limits, at_least=more)
    check_ocr_pages(len(sizes), "the image", limits, at_least=more)
    for number, (width, height) in enumerate(sizes, start=1):
        check_page_pixels(width, height, "the image" if len(sizes) == 1 else f"page {number} of the image", limits)
    check_document_pixels(sum(w * h for w, h in sizes), _frames_phrase(len(sizes)), limits)
    return sizes


def _check_layout(data: bytes, kind: str, frames: int) -> None:
    """IngestError(422) for an image with more than MAX_PARTS chunks (PNG) or segments (JPEG)
    before its pixel data, or tags in a TIFF frame's directory: Pillow reads them one by one in
    Python, a few microseconds each, so a file of millions would cost its header read seconds.
    The walk stops at the pixel data, or at the first thing it does not understand (Pillow
    then says what is wrong)."""
    label = kind.removeprefix("image/").upper()
    if kind == "image/png":
        at, parts = 8, 0
        while at + 8 <= len(data) and data[at + 4:at + 8] not in (b"IDAT", b"IEND"):
            at += 12 + int.from_bytes(data[at:at + 4], "big")  # length, type, data, CRC
            parts += 1
            if parts > MAX_PARTS:
                break
        what = "chunks before its image data"
    elif kind == "image/jpeg":
        at, parts = 2, 0
        while at + 4 <= len(data) and data[at] == 0xFF:
            marker = data[at + 1]
            if marker == 0xFF:  # fill byte
                at += 1
                continue
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) or marker == 0xDA:
                break  # a frame header (SOFn) or the scan: the pixel data
            at += 2 if 0xD0 <= marker <= 0xD8 or marker == 0x01 else 2 + int.from_bytes(data[at + 2:at + 4], "big")
            parts += 1
            if parts > MAX_PARTS:
                break
        what = "segments before its frame header"
    else:  # TIFF: each frame's directory, up to one past the page limit (headers() counts them)
        order = "little" if data[:2] == b"II" else "big"
        at, parts, seen = int.from_bytes(data[4:8], order), 0, set()
        while 8 <= at and at + 2 <= len(data) and at not in seen and len(seen) <= frames:
            seen.add(at)
            tags = int.from_bytes(data[at:at + 2], order)
            parts = max(parts, tags)
            at = int.from_bytes(data[at + 2 + 12 * tags:at + 6 + 12 * tags], order)  # the next directory
        what = "tags in a frame's directory"
    if parts > MAX_PARTS:
        raise IngestError(422, f"the image cannot be read: more than {MAX_PARTS} {what} (corrupt, or not a {label} "
                               "a scanner or camera writes)")


def frames(data: bytes, kind: str, limits: Limits = Limits()) -> Iterator[tuple[Image, float | None]]:
    """Each frame of the image (a TIFF's pages; one for PNG and JPEG) upright, in RGB, with
    transparency over white, and its resolution where the file gives a plausible one (dpi);
    IngestError for an image that cannot be read or is over a limit (checked first, headers())."""
    return _decode(data, kind, len(headers(data, kind, limits)))


def _decode(data: bytes, kind: str, count: int) -> Iterator[tuple[Image, float | None]]:
    from PIL import Image, ImageOps

    with _unreadable(kind):
        image = _open(data, kind)
        for index in range(count):
            if index:
                image.seek(index)
            frame = ImageOps.exif_transpose(image)
            if frame.mode in ("RGBA", "LA", "PA") or (frame.mode == "P" and "transparency" in frame.info):
                rgba = frame.convert("RGBA")
                frame = Image.new("RGB", rgba.size, "white")
                frame.paste(rgba, mask=rgba.getchannel("A"))
                del rgba
            dpi = image.info.get("dpi")
            yield frame if frame.mode == "RGB" else frame.convert("RGB"), \
                float(dpi[0]) if dpi and dpi[0] >= 70 else None


@contextlib.contextmanager
def _unreadable(kind: str):
    """Pillow's errors for a file it cannot read as IngestError(422) naming the format."""
    from PIL import Image

    label = kind.removeprefix("image/").upper()
    try:
        yield
    except IngestError:
        raise
    except Image.DecompressionBombError as e:  # not raised with the plugins opened directly; kept as a guard
        raise IngestError(413, f"the image is too large to read: {e}") from None
    except UNREADABLE as e:
        raise IngestError(422, f"the image cannot be read: {str(e).rstrip('.') or type(e).__name__} "
                               f"(corrupt or not a {label})") from None


def page_image(data: bytes, kind: str, number: int) -> Image:
    """Page `number` (1-based) of the image as OCR read it: upright, RGB."""
    for n, (frame, _) in enumerate(frames(data, kind), start=1):
        if n == number:
            return frame
    raise IndexError(f"the image has no page {number}")
