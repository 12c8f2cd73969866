"""`make bench-documents`: invoices as users have them (PDFs, scans), through ingestion and the
engine, against the fields their authors expect.

For each file of the directory (default ../shared/data/invoices, `NAME.pdf|png` beside
`NAME.json`): ingestion time per page, text-layer pages apart from pages read by OCR (a file
with any OCR page counts under OCR: images, scanned PDFs), whether the file could be read at
all (counted, with the reason: no tesseract installed, say), then the OCR engines compared on
those pages (bench/ocr.py: Tesseract, which ingest uses, against rapidocr, each
where installed), then one batched run of the engine over the readable files with
schemas/invoice-document.json in verbatim mode, and per field: exact matches with the
expectation (strings compared after trimming and case folding, amounts to the cent), and
what fraction of the string values got a box on the page.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench import ocr as ocr_bench
from structspec.config import Settings

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "schemas" / "invoice-document.json"
SUFFIXES = (".pdf", ".png", ".jpg", ".jpeg", ".tif", ".tiff")


def same(want, have) -> bool:
    if have is None:
        return False
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(have, (int, float)) and abs(float(have) - float(want)) < 0.005
    return str(have).strip().casefold() == str(want).strip().casefold()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.documents", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=ROOT.parent / "shared" / "data" / "invoices")
    p.add_argument("--model", default=None, help="the model (default: STRUCTSPEC_MODEL or the default one)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", type=Path, default=Path("bench-out/documents"))
    p.add_argument("--ocr-compare", action=argparse.BooleanOptionalAction, default=True,
                   help="compare the OCR engines on the images and --ocr-pdf-pages rendered PDF pages")
    p.add_argument("--ocr-pdf-pages", type=int, default=4,
                   help="PDFs whose first page is rendered for the OCR comparison, besides the images")
    args = p.parse_args(argv)

    from structspec.engine.engine import Engine, Request
    from structspec.ingest import IngestError, ingest
    from structspec.options import RequestOptions

    files = sorted(f for f in args.dir.iterdir() if f.suffix.lower() in SUFFIXES)
    if not files:
        p.error(f"no PDF or image in {args.dir}")
    schema = json.loads(SCHEMA.read_text())
    fields = list(schema["properties"])
    read, refused = [], []
    for f in files:
        data = f.read_bytes()
        t = time.perf_counter()
        try:
            doc = ingest(data, name=f.name)
        except IngestError as e:
            refused.append({"file": f.name, "status": e.status, "reason": str(e)})
            continue
        seconds = time.perf_counter() - t
        read.append({"file": f.name, "doc": doc, "pages": len(doc.pages), "ingest_s": seconds,
                     "ocr": any(page.ocr for page in doc.pages), "expected": ocr_bench.expected_of(f)})
    engines = None
    if args.ocr_compare:  # the images read by OCR, or refused for want of it, and a few rendered pages
        known = {r["file"]: (r["doc"].text, r["ingest_s"]) for r in read if r["ocr"]}
        wanted = set(known) | {x["file"] for x in refused if x["status"] == 415}
        engines = ocr_bench.compare([page for page in ocr_bench.pages_of(args.dir, args.ocr_pdf_pages, 3.0)
                                     if page["kind"] == "rendered" or page["page"] in wanted], known)

    settings = Settings.from_env(model=args.model)
    settings.apply_torch_threads()
    engine = Engine.from_settings(settings)
    opts = RequestOptions(strategy="composite", draft_len=8, max_tokens=args.max_tokens, verbatim=True)
    t = time.perf_counter()
    results = engine.run([Request(schema, r["doc"].text, opts) for r in read])
    extract_s = time.perf_counter() - t

    per_field = {name: {"matched": 0, "expected": 0} for name in fields}
    strings = boxed = 0
    rows = []
    for r, res in zip(read, results):
        value = res.value if res.status == "succeeded" else None
        boxes = r["doc"].locate_spans(res.spans) if value is not None else {}
        for name in fields:
            want = (r["expected"] or {}).get(name)
            if want is None:
                continue
            per_field[name]["expected"] += 1
            per_field[name]["matched"] += same(want, (value or {}).get(name))
            if value is not None and isinstance(value.get(name), str) and value[name]:
                strings += 1
                boxed += f"/{name}" in boxes
        rows.append({"file": r["file"], "pages": r["pages"], "ocr": r["ocr"],
                     "ingest_ms_per_page": round(1000 * r["ingest_s"] / r["pages"], 2),
                     "status": res.status, "value": value, "expected": {k: (r["expected"] or {}).get(k) for k in fields},
                     "boxes": boxes})
    pages = sum(r["pages"] for r in read)
    by_kind = {kind: [r for r in read if r["ocr"] == (kind == "ocr")] for kind in ("text_layer", "ocr")}
    per_page = {f"{kind}_ms_per_page": round(1000 * sum(r["ingest_s"] for r in rs) / sum(r["pages"] for r in rs), 2)
                if rs else None for kind, rs in by_kind.items()}
    report = {"model": engine.loaded.name, "dtype": str(engine.loaded.dtype), "schema": str(SCHEMA.relative_to(ROOT)),
              "files": len(files), "read": len(read), "refused": refused, "pages": pages,
              "text_layer_pages": sum(r["pages"] for r in by_kind["text_layer"]),
              "ocr_pages": sum(r["pages"] for r in by_kind["ocr"]), **per_page, "ocr_engines": engines,
              "extract_s": round(extract_s, 2), "succeeded": sum(res.status == "succeeded" for res in results),
              "per_field": {k: {**v, "accuracy": round(v["matched"] / v["expected"], 3) if v["expected"] else None}
                            for k, v in per_field.items()},
              "string_values": strings, "string_values_with_a_box": boxed, "documents": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "documents.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    names = ", ".join(f"{x['file']} ({x['status']}: {x['reason']})" for x in refused) or "none"
    print(f"{len(read)} of {len(files)} files read ({pages} pages: {report['text_layer_pages']} from a text layer, "
          f"{report['text_layer_ms_per_page']} ms a page; {report['ocr_pages']} by OCR, "
          f"{report['ocr_ms_per_page']} ms a page); refused: {names}")
    if engines is not None:
        ocr_bench.print_table(engines)
    print(f"model {report['model']} ({report['dtype']}): {report['succeeded']}/{len(read)} succeeded in "
          f"{report['extract_s']} s; string values with a box: {boxed}/{strings}")
    print("| field | matched | expected | accuracy |\n|---|---|---|---|")
    for k, v in report["per_field"].items():
        print(f"| {k} | {v['matched']} | {v['expected']} | {v['accuracy']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
