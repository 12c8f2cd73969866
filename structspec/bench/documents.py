"""`make bench-documents`: invoices as users have them (PDFs, scans), through ingestion and the
engine, against the fields their authors expect.

For each file of the directory (default ../shared/data/invoices, `NAME.pdf|png` beside
`NAME.json`): ingestion time per page, whether the file could be read at all (a scan needs OCR,
which this version lacks: counted, with the reason), then one batched run of the engine over the
readable ones with schemas/invoice-document.json in verbatim mode, and per field: exact matches
with the expectation (strings compared after trimming and case folding, amounts to the cent),
and what fraction of the string values got a box on the page.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from structspec.config import Settings

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "schemas" / "invoice-document.json"
SUFFIXES = (".pdf", ".png", ".jpg", ".jpeg", ".tif", ".tiff")


def expected_of(path: Path) -> dict | None:
    gold = path.with_suffix(".json")
    if not gold.exists():
        return None
    value = json.loads(gold.read_text())
    return value[0] if isinstance(value, list) else value


def same(want, have) -> bool:
    if have is None:
        return False
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(have, (int, float)) and abs(float(have) - float(want)) < 0.005
    return str(have).strip().casefold() == str(want).strip().casefold()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m structspec.bench.documents", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=ROOT.parent / "shared" / "data" / "invoices")
    p.add_argument("--model", default=None, help="the model (default: STRUCTSPEC_MODEL or the default one)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", type=Path, default=Path("bench-out/documents"))
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
                     "expected": expected_of(f)})

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
        rows.append({"file": r["file"], "pages": r["pages"], "ingest_ms_per_page": round(1000 * r["ingest_s"] / r["pages"], 2),
                     "status": res.status, "value": value, "expected": {k: (r["expected"] or {}).get(k) for k in fields},
                     "boxes": boxes})
    pages = sum(r["pages"] for r in read)
    report = {"model": engine.loaded.name, "dtype": str(engine.loaded.dtype), "schema": str(SCHEMA.relative_to(ROOT)),
              "files": len(files), "read": len(read), "refused": refused, "pages": pages,
              "ingest_ms_per_page": round(1000 * sum(r["ingest_s"] for r in read) / max(pages, 1), 2),
              "ocr": "not available in this version: scans and images are refused (see `refused`)",
              "extract_s": round(extract_s, 2), "succeeded": sum(res.status == "succeeded" for res in results),
              "per_field": {k: {**v, "accuracy": round(v["matched"] / v["expected"], 3) if v["expected"] else None}
                            for k, v in per_field.items()},
              "string_values": strings, "string_values_with_a_box": boxed, "documents": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "documents.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    names = ", ".join(f"{x['file']} ({x['status']})" for x in refused) or "none"
    print(f"{len(read)} of {len(files)} files read ({pages} pages, {report['ingest_ms_per_page']} ms a page); "
          f"refused: {names}")
    print(f"model {report['model']} ({report['dtype']}): {report['succeeded']}/{len(read)} succeeded in "
          f"{report['extract_s']} s; string values with a box: {boxed}/{strings}")
    print("| field | matched | expected | accuracy |\n|---|---|---|---|")
    for k, v in report["per_field"].items():
        print(f"| {k} | {v['matched']} | {v['expected']} | {v['accuracy']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
