"""Files as the API's bodies carry them: base64 `content` with a media type (POST
/v1/extractions, batch entries) and `data:` URLs (the OpenAI-compatible content parts), read
into a structspec.ingest.Document. Every problem is an IngestError naming it, with the HTTP
status that fits (413, 415, 422); each surface words and places the error its own way.

OCR runs while the request waits (~1-3 s a page here), so one request reads at most
REQUEST_OCR_PAGES pages by OCR across all its files (a batch, a chat request's parts): the
entries past that are refused naming the limit, and go in another request.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import replace

from structspec.ingest import Document, IngestError, Limits, ingest

REQUEST_OCR_PAGES = 5 * Limits().max_ocr_pages


def decode_base64(content: str) -> bytes:
    """`content`'s bytes; IngestError(422) when it is not base64."""
    try:
        return base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError) as e:
        raise IngestError(422, f"not valid base64: {e}") from None


def data_url(url: str) -> tuple[bytes, str | None]:
    """(bytes, media type or None) of a `data:[<media type>][;base64],<data>` URL; IngestError
    for any other URL (the service fetches nothing) or a malformed one."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0][:20] if ":" in url else "no scheme"
        raise IngestError(422, f"only data: URLs are read (the file inline, base64), not {scheme}: URLs; "
                               "or upload the file (purpose user_data) and give its file_id")
    head, sep, data = url[5:].partition(",")
    if not sep:
        raise IngestError(422, "a data: URL needs a comma before its data")
    params = head.split(";")
    media_type = params[0].strip() or None
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise IngestError(422, "a data: URL of a file must be base64 (data:<media type>;base64,<data>)")
    return decode_base64(data), media_type


class OcrBudget:
    """The OCR pages one request may still read (REQUEST_OCR_PAGES in all), each file within `limits`."""

    def __init__(self, pages: int = REQUEST_OCR_PAGES, limits: Limits = Limits()):
        self.total, self.left, self.limits = pages, pages, limits

    def read(self, data: bytes, media_type: str | None = None, name: str | None = None) -> Document:
        """ingest() within what is left; a file that needs more is refused naming the request's limit."""
        file_pages = self.limits.max_ocr_pages
        try:
            doc = ingest(data, media_type, name, limits=replace(self.limits, max_ocr_pages=min(file_pages, self.left)))
        except IngestError as e:
            if e.status == 413 and self.left < file_pages:  # the limit may be the request's, say so
                raise IngestError(413, f"{e} (one request's files may have {self.total} pages read by OCR in "
                                       f"all, {self.total - self.left} are taken: send the rest in another "
                                       "request)", e.code) from None
            raise
        self.left -= sum(page.ocr for page in doc.pages)
        return doc
