"""OCR engines compared on invoices: Tesseract (the `tesseract` command, what structspec.ingest
reads images with) and rapidocr-onnxruntime 1.4.4 (PaddleOCR's PP-OCRv4 models on onnxruntime,
the pip-installable alternative), each where it is installed.

    python -m bench.ocr [--dir ../shared/data/invoices] [--pdf-pages 4] [--scale 3]

Pages: the directory's page images (NAME.png|jpg|tif) and the first page of the first
`--pdf-pages` PDFs that have no image of the same name, rendered with pypdfium2 at `--scale`
pixels per point (3: 216 dpi, as ingest renders a scanned PDF page). Both engines read the
same image. Tesseract through `ingest` (decoding, one `tesseract` process a page, layout:
what a user waits for); rapidocr on the decoded image, its lines in the same reading order,
full-width punctuation made ASCII, its models loaded once beforehand (the time is reported).
Each engine runs on one thread (ingest runs Tesseract so; with their default threads both were
slower on this 2-core machine beside other work: Tesseract 2.9 s a page against 0.7 s).

Accuracy, against text nobody typed for the test:
- words (rendered pages): the words of the page's text layer (case-folded, stripped of
  surrounding punctuation) that the OCR text holds, counted with repeats (recall), and the
  share of the OCR words that are text-layer words (precision); `recall_ignoring_spaces`:
  text-layer words found in the OCR text with all its whitespace removed (an engine that runs
  words together loses words but not these).
- fields (every page with NAME.json): of the expected values that the PDF NAME.pdf's text
  layer holds as written (strings; ISO dates in the usual spellings; amounts as numbers),
  how many the OCR text holds; `found_ignoring_spaces` compares without whitespace.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import io
import json
import re
import shutil
import statistics
import string
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
PUNCTUATION = string.punctuation + "“”‘’«»"
FULL_WIDTH = {c: c - 0xFEE0 for c in range(0xFF01, 0xFF5F)}  # rapidocr writes some ASCII punctuation so
DATE_FORMATS = ("%Y-%m-%d", "%d/%m/%Y", "%m/%d/%Y", "%d-%m-%Y", "%d.%m.%Y", "%B %d, %Y", "%b %d, %Y",
                "%d %B %Y", "%d %b %Y", "%B %-d, %Y", "%b %-d, %Y", "%-d %B %Y", "%-d %b %Y")


# --- accuracy ------------------------------------------------------------------------------------

def expected_of(path: Path) -> dict | None:
    """The fields an invoice file's authors expect (NAME.json beside NAME.pdf|png; the first of
    a list), or None where there is no such file."""
    gold = path.with_suffix(".json")
    if not gold.exists():
        return None
    value = json.loads(gold.read_text())
    return value[0] if isinstance(value, list) else value


def words(text: str) -> Counter:
    out = Counter()
    for token in text.split():
        token = token.strip(PUNCTUATION).casefold()
        if any(c.isalnum() for c in token):
            out[token] += 1
    return out


def squash(text: str) -> str:
    return "".join(text.split()).casefold()


def word_scores(reference: str, text: str) -> dict:
    ref, got = words(reference), words(text)
    common = sum((ref & got).values())
    squashed = squash(text)
    return {"reference_words": sum(ref.values()), "recall": round(common / max(sum(ref.values()), 1), 3),
            "precision": round(common / max(sum(got.values()), 1), 3),
            "recall_ignoring_spaces": round(sum(n for w, n in ref.items() if w in squashed)
                                            / max(sum(ref.values()), 1), 3)}


def leaves(value, path: str = ""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, f"{path}/{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, f"{path}/{i}")
    elif value is not None and not isinstance(value, bool):
        yield path, value


def numbers_in(text: str) -> list[float]:
    """Every number written in `text` ("1,939.00", "4,11", "319"), as a float."""
    out = []
    for token in re.findall(r"\d[\d.,]*\d|\d", text):
        if "," in token and "." in token:
            token = token.replace(",", "") if token.rindex(".") > token.rindex(",") else \
                token.replace(".", "").replace(",", ".")
        elif "," in token:
            token = token.replace(",", ".") if re.fullmatch(r"\d+,\d{2}", token) else token.replace(",", "")
        try:
            out.append(float(token))
        except ValueError:
            continue
    return out


def spellings(value) -> list[str]:
    """How a string value may be written: itself, and an ISO date in the usual formats."""
    value = str(value).strip()
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
        d = date.fromisoformat(value)
        return sorted({d.strftime(f) for f in DATE_FORMATS})
    return [value]


def holds(text: str, value, ignore_spaces: bool = False) -> bool:
    if isinstance(value, (int, float)):
        return any(abs(n - value) < 0.005 for n in numbers_in(text))
    norm = squash if ignore_spaces else (lambda s: " ".join(s.split()).casefold())
    body = norm(text)
    return any(norm(s) and norm(s) in body for s in spellings(value))


def field_scores(expected: dict, text: str, reference: str | None) -> dict:
    """Of `expected`'s values the reference text holds (all of them without one), how many
    `text` holds, as written and ignoring whitespace."""
    findable = [(p, v) for p, v in leaves(expected) if reference is None or holds(reference, v)]
    found = [p for p, v in findable if holds(text, v)]
    loose = [p for p, v in findable if holds(text, v, ignore_spaces=True)]
    return {"findable": len(findable), "found": len(found), "found_ignoring_spaces": len(loose),
            "missed": [p for p, _ in findable if p not in found]}


# --- engines -------------------------------------------------------------------------------------

def tesseract_version() -> str | None:
    exe = shutil.which("tesseract")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return (out.stdout or out.stderr).splitlines()[0].strip()


def run_ingest(image: bytes, name: str) -> tuple[str, float]:
    """`image` through structspec.ingest (Tesseract): its text, and the seconds it took."""
    from structspec.ingest import IngestError, ingest

    t = time.perf_counter()
    try:
        text = ingest(image, name=name).text
    except IngestError as e:
        if e.status != 422:
            raise
        text = ""  # no text found
    return text, time.perf_counter() - t


def rapidocr_engine():
    """rapidocr's engine, or None when rapidocr-onnxruntime is not installed."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError:
        return None
    return RapidOCR(intra_op_num_threads=1, inter_op_num_threads=1)  # one thread, as Tesseract runs


def run_rapidocr(engine, image: bytes) -> tuple[str, float]:
    """`image` read by rapidocr, one text line per line it finds in structspec's reading order."""
    from PIL import Image

    from structspec.ingest.document import rows

    t = time.perf_counter()
    frame = Image.open(io.BytesIO(image)).convert("RGB")
    found, _ = engine(frame)
    lines = [RapidLine(str(text).translate(FULL_WIDTH), min(p[0] for p in quad), min(p[1] for p in quad),
                       max(p[1] for p in quad)) for quad, text, _ in found or []]
    text = "\n".join(line.text for row in rows(lines) for line in row)
    return text, time.perf_counter() - t


@dataclass
class RapidLine:
    text: str
    x0: float
    y0: float
    y1: float


# --- pages ---------------------------------------------------------------------------------------

def text_layer(pdf_path: Path, page: int = 0) -> str | None:
    """Page `page`'s text layer (PDFium's text, in drawing order), or None without the PDF."""
    import pypdfium2 as pdfium

    if not pdf_path.exists():
        return None
    pdf = pdfium.PdfDocument(pdf_path.read_bytes())
    try:
        textpage = pdf[page].get_textpage()
        return textpage.get_text_range()
    finally:
        pdf.close()


def render(pdf_path: Path, scale: float) -> bytes:
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument(pdf_path.read_bytes())
    try:
        buf = io.BytesIO()
        pdf[0].render(scale=scale).to_pil().convert("RGB").save(buf, "PNG")
        return buf.getvalue()
    finally:
        pdf.close()


def pages_of(directory: Path, pdf_pages: int, scale: float) -> list[dict]:
    """The images of `directory`, then the first page of `pdf_pages` PDFs without an image twin."""
    images = sorted(f for f in directory.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
    twins = {f.stem for f in images}
    pdfs = [f for f in sorted(directory.glob("*.pdf")) if f.stem not in twins][:pdf_pages]
    pages = [{"page": f.name, "kind": "scan", "image": f.read_bytes(), "suffix": f.suffix.lower(),
              "reference": None, "fields_reference": text_layer(f.with_suffix(".pdf")), "expected": expected_of(f)}
             for f in images]
    for f in pdfs:
        layer = text_layer(f)
        pages.append({"page": f"{f.name}#1@{scale:g}x", "kind": "rendered", "image": render(f, scale),
                      "suffix": ".png", "reference": layer, "fields_reference": layer, "expected": expected_of(f)})
    return pages


def compare(pages: list[dict], known: dict[str, tuple[str, float]] | None = None) -> dict:
    """Both engines on each page: seconds and accuracy per page and overall. `known`: Tesseract
    results already measured through ingest ({page: (text, seconds)}), not run again."""
    known = known or {}
    version = tesseract_version()
    t = time.perf_counter()
    rapid = rapidocr_engine()
    load_s = time.perf_counter() - t
    engines = {}
    if version:
        engines["tesseract"] = lambda p: known.get(p["page"]) or run_ingest(p["image"], "page" + p["suffix"])
    if rapid is not None:
        engines["rapidocr"] = lambda p: run_rapidocr(rapid, p["image"])
    rows = []
    for p in pages:
        row = {"page": p["page"], "kind": p["kind"]}
        for name, run in engines.items():
            text, seconds = run(p)
            result = {"s": round(seconds, 2), "chars": len(text)}
            if p["reference"] is not None:
                result["words"] = word_scores(p["reference"], text)
            if p["expected"] is not None:
                result["fields"] = field_scores(p["expected"], text, p["fields_reference"])
            row[name] = result
        rows.append(row)
    return {"tesseract": version or "not found: install it (Debian: apt-get install tesseract-ocr) to compare",
            "rapidocr": f"rapidocr-onnxruntime {md.version('rapidocr-onnxruntime')}, models loaded in {load_s:.2f} s"
                        if rapid is not None else
                        "not installed: pip install --no-deps rapidocr-onnxruntime==1.4.4 and onnxruntime, "
                        "opencv-python-headless, pyclipper, shapely to compare",
            "pages": rows, "summary": {name: summarise(rows, name) for name in engines}}


def summarise(rows: list[dict], engine: str) -> dict:
    mine = [r[engine] for r in rows]
    seconds = [m["s"] for m in mine]
    worded = [m["words"] for m in mine if "words" in m]
    fields = [m["fields"] for m in mine if "fields" in m]
    out = {"pages": len(mine), "s_per_page_mean": round(statistics.mean(seconds), 2),
           "s_per_page_median": round(statistics.median(seconds), 2)}
    if worded:
        total = sum(w["reference_words"] for w in worded)
        for key in ("recall", "precision", "recall_ignoring_spaces"):
            out[f"word_{key}"] = round(sum(w[key] * w["reference_words"] for w in worded) / total, 3)
    for kind in ("scan", "rendered"):
        got = [m["fields"] for r, m in zip(rows, mine) if "fields" in m and r["kind"] == kind]
        if got:
            out[f"fields_{kind}"] = f"{sum(f['found'] for f in got)}/{sum(f['findable'] for f in got)}"
            out[f"fields_{kind}_ignoring_spaces"] = \
                f"{sum(f['found_ignoring_spaces'] for f in got)}/{sum(f['findable'] for f in got)}"
    return out


def print_table(report: dict) -> None:
    print(f"OCR engines: tesseract: {report['tesseract']}; rapidocr: {report['rapidocr']}")
    engines = list(report["summary"])
    print("| page | " + " | ".join(f"{e} s | {e} words (recall/precision/ignoring spaces) | {e} fields"
                                     for e in engines) + " |")
    print("|---" * (1 + 3 * len(engines)) + "|")
    for r in report["pages"]:
        cells = []
        for e in engines:
            m = r[e]
            w = m.get("words")
            f = m.get("fields")
            cells += [str(m["s"]), f"{w['recall']}/{w['precision']}/{w['recall_ignoring_spaces']}" if w else "",
                      f"{f['found']}/{f['findable']} ({f['found_ignoring_spaces']} ignoring spaces)" if f else ""]
        print(f"| {r['page']} | " + " | ".join(cells) + " |")
    for e, s in report["summary"].items():
        print(f"{e}: " + ", ".join(f"{k} {v}" for k, v in s.items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ocr", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=ROOT.parent / "shared" / "data" / "invoices")
    p.add_argument("--pdf-pages", type=int, default=4, help="PDFs whose first page is rendered and read")
    p.add_argument("--scale", type=float, default=3.0, help="pixels per PDF point when rendering (3: 216 dpi)")
    p.add_argument("--out", type=Path, default=Path("bench-out/ocr"))
    args = p.parse_args(argv)
    if not args.dir.is_dir():
        print(f"{args.dir} not found: the OCR comparison needs the invoices of ../shared/data; skipped")
        return 0
    report = compare(pages_of(args.dir, args.pdf_pages, args.scale))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ocr.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
