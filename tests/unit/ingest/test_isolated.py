"""read_isolated: ingest() in a separate process whose memory and time are bounded, and whose
every way of failing is an IngestError. Memory is what the reading process reports of itself
from /proc/self/status (VmHWM, its peak resident set, less VmRSS when it started): it is a
child of the fork server, not of the test, so RUSAGE_CHILDREN here does not see it.

The failures no file can be relied on to cause (a crash, a hang) are injected with
isolated.measure's test-only `_fault`."""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pypdfium2 as pdfium
import pytest

from bench.hostile import big_page_pdf, png_file
from structspec.ingest import IngestError, Limits, ingest, isolated, read_isolated

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "invoices"
AZURE = FIXTURES / "AzureInterior.pdf"
GIB = 1024 ** 3
TSV_HEADER = "\t".join(["level", "page_num", "block_num", "par_num", "line_num", "word_num", "left", "top", "width",
                        "height", "conf", "text"])


def azure_png(crop: float = 0.3) -> bytes:
    """The top of AzureInterior's page rendered at 216 dpi, as a PNG: an invoice scan."""
    pdf = pdfium.PdfDocument(AZURE.read_bytes())
    image = pdf[0].render(scale=3).to_pil().convert("RGB")
    pdf.close()
    buf = io.BytesIO()
    image.crop((0, 0, image.width, round(image.height * crop))).save(buf, "PNG", dpi=(216, 216))
    return buf.getvalue()


@pytest.mark.parametrize("data", [AZURE.read_bytes(), azure_png()], ids=["pdf", "png"])
def test_an_invoice_reads_the_same_isolated_as_in_process(data):
    here, there = ingest(data), read_isolated(data, limits=Limits())
    assert there.text == here.text and there.chars == here.chars and there.pages == here.pages
    assert there.media_type == here.media_type and there.warnings == here.warnings == [] and there.source is data


def test_reads_from_several_threads_at_once_each_get_their_own_document():
    pdf, png = AZURE.read_bytes(), azure_png(0.15)
    want = {id(pdf): ingest(pdf).text, id(png): ingest(png).text}
    names = []

    def read(data):
        names.append(threading.current_thread().name)
        return id(data), read_isolated(data, limits=Limits()).text

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(read, [pdf, png, pdf, png]))
    assert [text for _, text in got] == [want[key] for key, _ in got]
    assert threading.main_thread().name not in names


def test_a_200_inch_scanned_page_costs_the_reading_process_under_1_gib(fake_tesseract):
    """Issue 63's 1 KB PDF took the reading process to 6.1 GiB. Rendered within
    ingest_max_page_pixels it stays far under 1 GiB above its start; a stand-in tesseract
    (reads the page, finds nothing) keeps this test fast: test_..._with_tesseract runs the real one."""
    path = fake_tesseract("cat > /dev/null")
    reading = isolated.measure(big_page_pdf(), limits=Limits(), _fault=f"path:{path}")
    print(f"peak above baseline {reading.peak_above_baseline / 2 ** 20:.0f} MiB in {reading.wall_s:.1f} s")
    assert reading.error is not None and reading.error.code == "no_text_found", reading.error
    assert "rendered at 35 dpi instead of 216" in str(reading.error)
    assert 0 < reading.peak_above_baseline < GIB


@pytest.mark.slow
def test_a_200_inch_scanned_page_costs_the_reading_process_under_1_gib_with_tesseract():
    reading = isolated.measure(big_page_pdf(), limits=Limits())
    print(f"peak above baseline {reading.peak_above_baseline / 2 ** 20:.0f} MiB, tesseract "
          f"{reading.ocr_peak_rss / 2 ** 20:.0f} MiB, in {reading.wall_s:.1f} s")
    assert (reading.document is not None and reading.document.warnings) or reading.error.code == "no_text_found"
    assert 0 < reading.peak_above_baseline < GIB and reading.ocr_peak_rss < reading.memory_limit


def test_tesseract_runs_under_the_reading_process_memory_limit(fake_tesseract):
    path = fake_tesseract('cat > /dev/null; printf "%s\\n5\\t1\\t1\\t1\\t1\\t1\\t1\\t1\\t9\\t9\\t95\\tAS=%s\\n" '
                          f'"{TSV_HEADER}" "$(ulimit -v)"')
    reading = isolated.measure(azure_png(0.05), limits=Limits(max_memory_bytes=512 * 1024 ** 2),
                               _fault=f"path:{path}")
    assert reading.error is None, reading.error
    assert reading.document.text == f"AS={reading.memory_limit // 1024}"  # ulimit -v is in KiB


def test_a_reading_past_its_memory_limit_is_read_memory():
    """A 6000 x 6000 PNG decodes to 108 MB in RGB; the reading process may have 64 MiB more."""
    reading = isolated.measure(png_file(6000, 6000), limits=Limits(max_memory_bytes=64 * 1024 ** 2))
    assert (reading.error.status, reading.error.code) == (413, "read_memory"), reading.error
    assert "ingest_max_memory_mb" in str(reading.error)


@pytest.mark.parametrize("fault, status, code, message", [
    ("allocate", 413, "read_memory", r"more than its memory limit, 1024 MiB above .*\(ingest_max_memory_mb\)"),
    ("abort", 413, "read_memory", r"aborted \(SIGABRT\).*\(ingest_max_memory_mb\)"),
    ("segfault", 422, "read_crashed", r"the process reading the file was killed by SIGSEGV"),
    ("exit", 422, "read_crashed", r"the process reading the file exited with status 3 without an answer"),
])
def test_a_reading_process_that_dies_is_an_ingest_error(fault, status, code, message):
    reading = isolated.measure(AZURE.read_bytes(), limits=Limits(), _fault=fault)
    assert reading.document is None and isinstance(reading.error, IngestError)
    assert (reading.error.status, reading.error.code) == (status, code)
    with pytest.raises(IngestError, match=message):
        raise reading.error


def test_a_reading_process_past_the_time_limit_is_killed():
    reading = isolated.measure(AZURE.read_bytes(), limits=Limits(timeout_s=0.5), _fault="sleep")
    assert (reading.error.status, reading.error.code) == (422, "read_timeout")
    assert "longer than its limit of 0.5 s (ingest_timeout_s): the process reading it was stopped" in str(reading.error)
    assert reading.wall_s < 0.5 + isolated.KILL_MARGIN_S + 2


def test_read_isolated_raises_what_ingest_raises():
    with pytest.raises(IngestError, match=r"the image is 30000 x 30000 pixels.*ingest_max_page_pixels") as e:
        read_isolated(png_file(30000, 30000), limits=Limits())
    assert e.value.code == "file_too_large"
    assert read_isolated(b"plain text", limits=Limits()).text == "plain text"
