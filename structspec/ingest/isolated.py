"""ingest() in a separate process, so that a hostile file costs bounded memory and time and
cannot take the caller (a worker holding a model) down.

The reading process is forked from a `multiprocessing` fork server started once per calling
process, which has imported the decoders (pypdfium2, Pillow) beforehand: the caller itself is
never forked (it may hold torch and running threads), and a reading does not pay for those
imports. As with any spawn or forkserver child, the caller's main module is imported in the
reading process (as `__mp_main__`): a script that reads files at import time, not under
`if __name__ == "__main__":`, fails there (multiprocessing's "Safe importing of main module"),
and every reading from it is refused as `read_crashed`.

pdf_pages() runs probe()'s PDFium open the same way, for at most PROBE_OPEN_TIMEOUT_S.

Bounds:
- memory: the reading process sets its own address-space limit (RLIMIT_AS, soft and hard) to
  its size once started (the decoders, and the file, already in it) plus
  ingest_max_memory_mb; the `tesseract` processes it starts inherit that limit. A reading
  that reaches it gets a MemoryError (Python, Pillow, pypdfium2's bitmaps) or is aborted
  (PDFium's own allocator calls abort(), SIGABRT) or Tesseract fails to allocate: all are
  IngestError 413 `read_memory`;
- time: ingest() checks ingest_timeout_s itself between pages and bounds each OCR run with
  it; the caller kills the process KILL_MARGIN_S after it (a single PDFium call that runs
  on), IngestError 422 `read_timeout`;
- a process that dies otherwise (a signal, an exit without an answer) is IngestError 422
  `read_crashed`, naming how it ended. The caller never sees another exception type for a
  file; a fork server that cannot start (the machine out of processes) is the server's
  problem and raises as it is.

The answer comes back through a pipe as JSON and two flat arrays (the characters' pages and
lines, and their boxes), parsed with json and array: nothing the reading process sends is
unpickled. Safe to call from any thread, and from several at once (each reading its own
process).

Cost (the per-call overhead, measured on this project's 2-core CPU machine with
AzureInterior.pdf, a one-page text-layer invoice, median of 20): 7 ms in-process against
36 ms through read_isolated, the fork server already started; starting it took 0.3 s, once
per calling process.
"""

from __future__ import annotations

import array
import json
import multiprocessing
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

from structspec.ingest import ingest
from structspec.ingest.document import FILE_ERRORS, CharPlace, Document, IngestError, Page
from structspec.ingest.limits import MIB, SETTINGS, Limits

# after ingest_timeout_s, the reading process has this long to report its own timeout (naming
# the page it stopped at) before it is killed
KILL_MARGIN_S = 2.0
# what a probe allows PDFium to open a PDF and count its pages (milliseconds for a sound file;
# a cross-reference rebuilt from a crafted 2 MB file took 150 s here)
PROBE_OPEN_TIMEOUT_S = 5.0
# imported once by the fork server, so that each reading starts with them loaded
PRELOAD = ["structspec.ingest.isolated", "pypdfium2", "pypdfium2.raw", "PIL.Image", "PIL.ImageOps",
           "PIL.PngImagePlugin", "PIL.JpegImagePlugin", "PIL.TiffImagePlugin"]

_context = None
_context_lock = threading.Lock()


@dataclass(frozen=True)
class Reading:
    """One isolated reading: its Document or its IngestError, and what it cost."""

    document: Document | None
    error: IngestError | None
    wall_s: float
    baseline_rss: int | None = None  # bytes resident in the reading process once started (decoders, file)
    peak_rss: int | None = None  # its peak resident bytes (VmHWM), as it reported them at its end
    ocr_peak_rss: int | None = None  # the peak resident bytes of its largest tesseract run
    memory_limit: int | None = None  # the address-space limit it set itself (bytes)

    @property
    def peak_above_baseline(self) -> int | None:
        if self.peak_rss is None or self.baseline_rss is None:
            return None
        return self.peak_rss - self.baseline_rss


def read_isolated(data: bytes, media_type: str | None = None, name: str | None = None, *,
                  limits: Limits) -> Document:
    """ingest(data, media_type, name, limits=limits), read in a separate process bounded by
    `limits` (max_memory_bytes, timeout_s); IngestError for every way it can fail, crashes
    included. The Document's source is `data` itself."""
    reading = measure(data, media_type, name, limits=limits)
    if reading.error is not None:
        raise reading.error
    return reading.document


def measure(data: bytes, media_type: str | None = None, name: str | None = None, *, limits: Limits,
            _fault: str | None = None) -> Reading:
    """read_isolated(), with what it cost (for bench.hostile and the tests), the
    error returned rather than raised. `_fault` (tests only) names a function of _FAULTS that
    the reading process runs first ("name" or "name:argument")."""
    timeout = (f"reading the document took longer than its limit of {limits.timeout_s:g} s "
               f"({SETTINGS['timeout_s']}): the process reading it was stopped")
    message, error, wall_s = _run("ingest", data, media_type, name, limits, limits.timeout_s + KILL_MARGIN_S,
                                  timeout, _fault)
    if error is not None:
        return Reading(None, error, wall_s)
    try:
        return _reading(message, data, wall_s)
    except (ValueError, KeyError, TypeError, IndexError) as e:  # not what _child sends
        return Reading(None, IngestError(422, f"the process reading the file answered garbage ({e})",
                                         code="read_crashed"), wall_s)


def pdf_pages(data: bytes, limits: Limits) -> int:
    """The PDF's page count as PDFium opens it, in a separate process bounded like a reading
    but given at most PROBE_OPEN_TIMEOUT_S (probe(): opening a file whose cross-reference
    PDFium must rebuild can take time quadratic in its size); IngestError as opening raises
    it, or for the process's timeout, memory or death."""
    seconds = min(PROBE_OPEN_TIMEOUT_S, limits.timeout_s)
    timeout = (f"opening the PDF took longer than {seconds:g} s (a probe allows PDFium {PROBE_OPEN_TIMEOUT_S:g} s, "
               f"and no more than {SETTINGS['timeout_s']}): the process opening it was stopped")
    message, error, _ = _run("pdf_pages", data, None, None, limits, seconds, timeout)
    if error is not None:
        raise error
    header = json.loads(message[0])
    if "error" in header:
        raise _error(header["error"])
    return int(header["pages"])


def _run(task: str, data: bytes, media_type: str | None, name: str | None, limits: Limits, seconds: float,
         timeout_message: str, fault: str | None = None) -> tuple[list[bytes] | None, IngestError | None, float]:
    """Run _child(task) on `data`: (its answer, None, wall seconds), or (None, the IngestError of
    its death or of its time running out after `seconds`, wall seconds)."""
    ctx = _mp_context()
    start = time.monotonic()
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(sender, task, data, media_type, name, limits, fault),
                          name=f"structspec-{task}", daemon=True)
    try:
        process.start()
    except BaseException:
        receiver.close()
        raise
    finally:
        sender.close()  # the child's copy is the only one left: its death ends the pipe
    deadline = start + seconds
    try:
        try:
            message = _receive(receiver, process, deadline)
        except TimeoutError:
            process.kill()
            process.join()
            return None, IngestError(422, timeout_message, code="read_timeout"), time.monotonic() - start
        process.join(max(deadline - time.monotonic(), 1.0))  # it exits once its answer is sent
        if process.exitcode is None:
            process.kill()
            process.join()
        if message is None:
            return None, _death(process.exitcode, limits), time.monotonic() - start
        return message, None, time.monotonic() - start
    finally:
        receiver.close()
        process.close()


def _mp_context():
    """The forkserver context, its preload set before the fork server first starts."""
    global _context
    with _context_lock:
        if _context is None:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
        return _context


def _receive(receiver, process, deadline: float) -> list[bytes] | None:
    """The child's answer (its JSON header, then two arrays when it is a document), or None
    when it died without one; TimeoutError past the deadline."""
    parts: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        ready = wait([receiver, process.sentinel], timeout=left)
        if not ready:
            raise TimeoutError
        if receiver not in ready and not receiver.poll(0):
            return None  # it ended (the sentinel) and sent nothing more
        try:
            parts.append(receiver.recv_bytes())
        except (EOFError, OSError):
            return None
        if len(parts) == 1 and b'"document"' not in parts[0]:  # an error: the header alone
            return parts
        if len(parts) == 3:
            return parts


def _reading(message: list[bytes], data: bytes, wall_s: float) -> Reading:
    header = json.loads(message[0])
    stats = {k: header.get(k) for k in ("baseline_rss", "peak_rss", "ocr_peak_rss", "memory_limit")}
    if "error" in header:
        return Reading(None, _error(header["error"]), wall_s, **stats)
    body = header["document"]
    lines = array.array("i")
    lines.frombytes(message[1])
    boxes = array.array("d")
    boxes.frombytes(message[2])
    chars: list[CharPlace | None] = [
        None if lines[2 * i] == 0 else
        CharPlace(lines[2 * i], lines[2 * i + 1], (boxes[4 * i], boxes[4 * i + 1], boxes[4 * i + 2], boxes[4 * i + 3]))
        for i in range(len(lines) // 2)]
    pages = [Page(number, width, height, unit, bool(is_ocr)) for number, width, height, unit, is_ocr in body["pages"]]
    doc = Document(text=body["text"], media_type=body["media_type"], pages=pages, chars=chars,
                   source=data if pages else b"", warnings=body["warnings"])
    return Reading(doc, None, wall_s, **stats)


def _error(fields: list) -> IngestError:
    status, text, code = fields
    if code not in FILE_ERRORS or not isinstance(status, int):
        return IngestError(422, f"the process reading the file answered an unknown error: {text}", "read_crashed")
    return IngestError(status, str(text), code)


def _death(exitcode: int | None, limits: Limits) -> IngestError:
    """The IngestError of a reading process that ended without an answer."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
        if -exitcode == signal.SIGABRT:  # PDFium's allocator aborts when an allocation fails
            return IngestError(413, f"the process reading the file was aborted ({name}), as the PDF decoder does when "
                                    f"it runs out of memory: the limit is {limits.max_memory_bytes // MIB} MiB above "
                                    f"its start ({SETTINGS['max_memory_bytes']})", code="read_memory")
        how = f"was killed by {name}" + (" (from outside: the system's out-of-memory killer, or an operator)"
                                         if -exitcode == signal.SIGKILL else "")
    else:
        how = f"exited with status {exitcode} without an answer"
    return IngestError(422, f"the process reading the file {how}", code="read_crashed")


# --- the reading process ----------------------------------------------------------------------

def _child(conn, task: str, data: bytes, media_type: str | None, name: str | None, limits: Limits,
           fault: str | None) -> None:
    """The reading process: `task` ("ingest": the Document; "pdf_pages": the page count) on
    `data` under its memory limit, answered through `conn` (see _receive)."""
    header: dict = {"baseline_rss": _status("VmRSS")}
    blobs: list[bytes] = []
    try:
        header["memory_limit"] = _limit_memory(limits.max_memory_bytes)
        if fault is not None:
            kind, _, arg = fault.partition(":")
            _FAULTS[kind](limits, arg)
        if task == "pdf_pages":
            from structspec.ingest.pdf import open_pdf

            pdf = open_pdf(data)
            header["pages"] = len(pdf)
            pdf.close()
        else:
            doc = ingest(data, media_type, name, limits=limits)
            del data
            header["document"] = {"text": doc.text, "media_type": doc.media_type, "warnings": doc.warnings,
                                  "pages": [[p.number, p.width, p.height, p.unit, int(p.ocr)] for p in doc.pages]}
            lines, boxes = array.array("i"), array.array("d")
            for place in doc.chars:
                if place is None:
                    lines.extend((0, 0))
                    boxes.extend((0.0, 0.0, 0.0, 0.0))
                else:
                    lines.extend((place.page, place.line))
                    boxes.extend(place.box)
            blobs = [lines.tobytes(), boxes.tobytes()]
    except IngestError as e:
        message = str(e)
        if e.code == "read_memory" and SETTINGS["max_memory_bytes"] not in message:  # ingest()'s MemoryError
            message += f": the limit is {limits.max_memory_bytes // MIB} MiB above the reading process's start " \
                       f"({SETTINGS['max_memory_bytes']})"
        header["error"] = [e.status, message, e.code]
    except MemoryError:
        header["error"] = [413, f"reading the file took more than its memory limit, {limits.max_memory_bytes // MIB} "
                                f"MiB above the reading process's start ({SETTINGS['max_memory_bytes']})",
                           "read_memory"]
    except Exception as e:  # a decoder's own failure on this file: the file's problem, named
        header["error"] = [422, f"reading the file failed: {type(e).__name__}: {e}", "read_crashed"]
    header["peak_rss"] = _status("VmHWM")
    header["ocr_peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 or None
    conn.send_bytes(json.dumps(header).encode())
    for blob in blobs:
        conn.send_bytes(blob)
    conn.close()


def _status(field: str) -> int | None:
    """A size from /proc/self/status (VmSize, VmRSS, VmHWM) in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # given in kB
    except OSError:
        pass
    return None


def _limit_memory(max_bytes: int) -> int | None:
    """Set this process's address-space limit to its size now plus `max_bytes` (no higher than
    the hard limit it has); the limit set, or None where the size cannot be read."""
    size = _status("VmSize")
    if size is None:
        return None
    limit = size + max_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return limit


# Failures for tests (measure's _fault, "name" or "name:argument"): what no file can be relied
# on to cause, and a way to put a stand-in `tesseract` first on the reading process's PATH (it
# inherits the fork server's environment, not the caller's at the time of the call).
def _fault_exit(limits: Limits, arg: str) -> None:
    os._exit(3)


def _fault_segfault(limits: Limits, arg: str) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def _fault_abort(limits: Limits, arg: str) -> None:
    os.abort()


def _fault_sleep(limits: Limits, arg: str) -> None:
    time.sleep(limits.timeout_s + KILL_MARGIN_S + 60)


def _fault_allocate(limits: Limits, arg: str) -> None:
    bytearray(limits.max_memory_bytes + MIB)


def _fault_path(limits: Limits, arg: str) -> None:
    os.environ["PATH"] = arg + os.pathsep + os.environ.get("PATH", "")


_FAULTS = {"exit": _fault_exit, "segfault": _fault_segfault, "abort": _fault_abort, "sleep": _fault_sleep,
           "allocate": _fault_allocate, "path": _fault_path}
