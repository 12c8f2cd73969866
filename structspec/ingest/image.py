"""Images (PNG, JPEG, TIFF): each frame a page, its text read by OCR (ocr.py), every
character's box in the image's pixels (unit "px"), from the top-left corner of the image as
it is displayed (a JPEG's EXIF orientation applied).
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from structspec.ingest.document import CharPlace, Document, IngestError, Page
from structspec.ingest.ocr import find_lines, page_text

if TYPE_CHECKING:
    from PIL.Image import Image

MAX_PIXELS = 50_000_000  # a frame's width x height: an A4 page scanned at 600 dpi is 35 million


def read_image(data: bytes, kind: str, name: str | None, max_pages: int, max_ocr_pages: int) -> Document:
    doc = Document(text="", media_type=kind, source=data)
    parts: list[str] = []
    places: list[CharPlace | None] = []
    line_no = 0
    for number, (frame, dpi) in enumerate(frames(data, kind, min(max_pages, max_ocr_pages)), start=1):
        doc.pages.append(Page(number, frame.width, frame.height, unit="px", ocr=True))
        text, page_places = page_text(find_lines(frame, dpi), number, line_no)
        if not text:
            continue
        if parts:  # a blank line between pages, as in a PDF
            parts.append("\n\n")
            places += [None, None]
        parts.append(text)
        places += page_places
        line_no += text.count("\n") + 1
    if not parts:
        raise IngestError(422, f"no text found in the image{f' {name}' if name else ''} (OCR read nothing)")
    doc.text = "".join(parts)
    doc.chars = places
    return doc


def frames(data: bytes, kind: str, max_pages: int | None = None) -> Iterator[tuple[Image, float | None]]:
    """Each frame of the image (a TIFF's pages; one for PNG and JPEG) upright, in RGB, with
    transparency over white, and its resolution where the file gives a plausible one (dpi);
    IngestError for an image that cannot be read or is too large."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    label = kind.removeprefix("image/").upper()
    try:
        image = Image.open(io.BytesIO(data))
        count = getattr(image, "n_frames", 1) if image.format == "TIFF" else 1
        if max_pages is not None and count > max_pages:
            raise IngestError(413, f"the image has {count} pages; the limit is {max_pages} pages")
        for index in range(count):
            image.seek(index)
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise IngestError(413, f"the image is {width}x{height} pixels; the limit is {MAX_PIXELS} pixels")
            frame = ImageOps.exif_transpose(image)
            if frame.mode in ("RGBA", "LA", "PA") or (frame.mode == "P" and "transparency" in frame.info):
                rgba = frame.convert("RGBA")
                frame = Image.new("RGB", rgba.size, "white")
                frame.paste(rgba, mask=rgba.getchannel("A"))
            dpi = image.info.get("dpi")
            yield frame.convert("RGB"), float(dpi[0]) if dpi and dpi[0] >= 70 else None
    except IngestError:
        raise
    except Image.DecompressionBombError as e:
        raise IngestError(413, f"the image is too large to read: {e}") from None
    except UnidentifiedImageError:
        raise IngestError(422, f"the image cannot be read: Pillow does not recognise it (corrupt or not a {label})") \
            from None
    except (OSError, SyntaxError, ValueError, EOFError, zlib.error) as e:
        raise IngestError(422, f"the image cannot be read: {str(e).rstrip('.') or type(e).__name__} "
                               f"(corrupt or not a {label})") from None


def page_image(data: bytes, kind: str, number: int) -> Image:
    """Page `number` (1-based) of the image as OCR read it: upright, RGB."""
    for n, (frame, _) in enumerate(frames(data, kind), start=1):
        if n == number:
            return frame
    raise IndexError(f"the image has no page {number}")
