"""`python -m bench.hostile`: hostile files against ingestion's budgets (issue 63).

Builds small files that would cost a reader without limits gigabytes or minutes, and real
invoices for comparison, and reads each with probe() (the API's cheap checks), then with
read_isolated() (the worker's reading in a bounded process; not the PDF whose repair is
quadratic, which would spend its whole ingest_timeout_s), with the default Limits. One JSON
line per file and reader: the outcome (status, code and message, or the text's length and the
warnings), the wall time, and for read_isolated the reading process's peak resident memory
above its baseline (VmHWM less VmRSS at its start, as it reports them from /proc/self/status)
and its largest tesseract run's peak (ru_maxrss of its children).

The builders write PDFs and PNGs by hand, a few kilobytes each, without ever holding what
they decode to; tests/unit/ingest uses them too.
"""

from __future__ import annotations

import argparse
import json
import struct
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INVOICES = ROOT.parent / "shared" / "data" / "invoices"


# --- PDFs --------------------------------------------------------------------------------------

def pdf_file(objects: list[bytes]) -> bytes:
    """A PDF of `objects` (object i + 1 is objects[i]; object 1 the catalog), with its
    cross-reference table."""
    out = bytearray(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def stream(data: bytes, entries: bytes = b"") -> bytes:
    return b"<< /Length %d %s>>\nstream\n" % (len(data), entries) + data + b"\nendstream"


def deflated(size: int, fill: bytes = b"\x00", head: bytes = b"", tail: bytes = b"", level: int = 9) -> bytes:
    """zlib of `head`, `size` bytes of `fill`, then `tail`, compressed 16 MiB at a time (never
    held whole)."""
    compressor, block = zlib.compressobj(level), fill * (16 * 1024 * 1024 // len(fill))
    parts = [compressor.compress(head)]
    while size > 0:
        parts.append(compressor.compress(block[:min(size, len(block))]))
        size -= len(block)
    parts.append(compressor.compress(tail) + compressor.flush())
    return b"".join(parts)


def pages_pdf(count: int, width: float = 612, height: float = 792, content: bytes = b"0 0 0 rg 10 10 50 50 re f",
              resources: bytes = b"", extra: list[bytes] | None = None) -> bytes:
    """`count` pages of `width` x `height` points that share one content stream (by default a
    filled square: no text layer, so each is a scan to OCR)."""
    kids = b" ".join(b"%d 0 R" % (4 + i) for i in range(count))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, count),
               stream(content)]
    objects += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %g %g] /Contents 3 0 R /Resources << %s >> >>"
                % (width, height, resources) for _ in range(count)]
    return pdf_file(objects + (extra or []))


def big_page_pdf(side_pt: float = 14400) -> bytes:
    """One page of `side_pt` points square (14400: 200 inches, the largest PDF allows) with no
    text layer that draws a filled rectangle: 1.87 billion pixels at 216 dpi."""
    return pages_pdf(1, side_pt, side_pt, b"0.5 g 100 100 %g %g re f" % (side_pt - 200, side_pt - 200))


def flate_bomb_pdf(inflated: int) -> bytes:
    """One page whose content stream is `inflated` zero bytes, Flate-compressed (~1000:1), and
    a line of text after them (zero bytes are white space to a PDF reader)."""
    data = deflated(inflated, tail=b"\nBT /F1 24 Tf 72 700 Td (Hello) Tj ET")
    return pdf_file([b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
                     b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
                     b"/Resources << /Font << /F1 5 0 R >> >> >>",
                     stream(data, b"/Filter /FlateDecode "),
                     b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"])


def object_stream_bomb_pdf(inflated: int) -> bytes:
    """A PDF whose catalog and page tree sit in an object stream padded to `inflated` bytes:
    PDFium inflates all of it to open the file (and count its pages)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>"]
    header = b"1 0 2 %d " % (len(objects[0]) + 1)
    body = header + objects[0] + b"\n" + objects[1] + b"\n"
    packed = deflated(inflated - len(body), b" ", head=body)
    out = bytearray(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = {}

    def add(number: int, obj: bytes) -> None:
        offsets[number] = len(out)
        out.extend(b"%d 0 obj\n" % number + obj + b"\nendobj\n")

    add(3, b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>")
    add(4, stream(b"0 0 0 rg 10 10 50 50 re f"))
    add(5, b"<< /Type /ObjStm /N 2 /First %d /Length %d /Filter /FlateDecode >>\nstream\n" % (len(header), len(packed))
        + packed + b"\nendstream")
    xref_at = len(out)
    rows = [struct.pack(">BIH", 0, 0, 65535), struct.pack(">BIH", 2, 5, 0), struct.pack(">BIH", 2, 5, 1)]
    rows += [struct.pack(">BIH", 1, offsets[n], 0) for n in (3, 4, 5)] + [struct.pack(">BIH", 1, xref_at, 0)]
    table = b"".join(rows)
    out += b"6 0 obj\n<< /Type /XRef /Size 7 /W [1 4 2] /Root 1 0 R /Length %d >>\nstream\n" % len(table)
    out += table + b"\nendstream\nendobj\nstartxref\n%d\n%%%%EOF\n" % xref_at
    return bytes(out)


def image_in_pdf(width: int, height: int) -> bytes:
    """One letter page (no text layer) drawing a 1-bit image of `width` x `height` pixels, all
    black: PDFium would decode all of its pixels to draw it."""
    data = deflated((width + 7) // 8 * height, level=6)
    image = stream(data, b"/Type /XObject /Subtype /Image /Width %d /Height %d /ColorSpace /DeviceGray "
                         b"/BitsPerComponent 1 /Filter /FlateDecode " % (width, height))
    return pages_pdf(1, content=b"q 500 0 0 500 50 150 cm /Im0 Do Q", resources=b"/XObject << /Im0 5 0 R >>",
                     extra=[image])


# --- images ------------------------------------------------------------------------------------

def png_file(width: int, height: int) -> bytes:
    """A 1-bit greyscale PNG of `width` x `height` pixels, all black; its IDAT compressed a
    block of rows at a time (30000 x 30000: 110 MB of rows through zlib, a 110 KB file)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row = b"\x00" + bytes((width + 7) // 8)  # filter type 0, then the row's bits
    compressor, parts, left = zlib.compressobj(6), [], height
    block = row * max(1, (4 * 1024 * 1024) // len(row))
    while left > 0:
        rows = min(left, len(block) // len(row))
        parts.append(compressor.compress(block[:rows * len(row)]))
        left -= rows
    parts.append(compressor.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


# --- the run -----------------------------------------------------------------------------------

def repair_pdf(objects: int = 20000) -> bytes:
    """Objects with streams and no `endobj`, and no cross-reference: PDFium's repair of the file
    takes time quadratic in its size (20000 of them, 660 KB: 26 s here; 2 MB: 150 s)."""
    return b"%PDF-1.7\n" + b"1 0 obj << >>stream\nxx\nendstream\n" * objects


def cases(invoices: Path) -> list[tuple[str, bytes]]:
    out = [("pdf-200-inch-page", big_page_pdf()),
           ("pdf-repair-quadratic-660KB", repair_pdf()),
           ("png-30000x30000", png_file(30000, 30000)),
           ("pdf-flate-bomb-1GiB", flate_bomb_pdf(1024 ** 3)),
           ("pdf-object-stream-bomb-1GiB", object_stream_bomb_pdf(1024 ** 3)),
           ("pdf-image-30000x30000", image_in_pdf(30000, 30000))]
    for name in ("AzureInterior.pdf", "oyo.png"):
        if (invoices / name).exists():
            out.append((f"invoice-{name}", (invoices / name).read_bytes()))
    return out


def outcome(result) -> dict:
    from structspec.ingest import IngestError

    if isinstance(result, IngestError):
        return {"status": result.status, "code": result.code, "message": str(result)}
    if hasattr(result, "text"):
        return {"chars": len(result.text), "pages": len(result.pages), "warnings": result.warnings}
    return {"media_type": result.media_type, "pages": result.pages}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--invoices", type=Path, default=INVOICES, help="where AzureInterior.pdf and oyo.png are")
    args = p.parse_args(argv)

    from structspec.ingest import IngestError, Limits, probe
    from structspec.ingest.isolated import measure

    limits = Limits()
    for name, data in cases(args.invoices):
        t = time.perf_counter()
        try:
            result = probe(data, limits=limits)
        except IngestError as e:
            result = e
        print(json.dumps({"file": name, "bytes": len(data), "reader": "probe",
                          "wall_s": round(time.perf_counter() - t, 3), **outcome(result)}), flush=True)
        if name.startswith("pdf-repair"):
            continue  # see the docstring
        reading = measure(data, limits=limits)
        above = reading.peak_above_baseline
        print(json.dumps({"file": name, "bytes": len(data), "reader": "read_isolated",
                          "wall_s": round(reading.wall_s, 3),
                          "peak_rss_above_baseline_mib": None if above is None else round(above / 2 ** 20, 1),
                          "ocr_peak_rss_mib": None if reading.ocr_peak_rss is None
                          else round(reading.ocr_peak_rss / 2 ** 20, 1),
                          **outcome(reading.error or reading.document)}), flush=True)


if __name__ == "__main__":
    main()
