"""Extraction quality by model: schema-valid results and field accuracy on DeepJSONEval,
synthetic receipts and synthetic e-mails (all carry gold values; the e-mails, schemas/contact.json
in verbatim mode, are the documents the default model reads best), and whether per-value
confidence is calibrated: field accuracy by confidence bucket. Greedy `none`, one model per run.

    python -m bench.quality [--model default] [--limit 48] [--receipts 32] [--emails 32]
                                       [--out bench-out]

Field accuracy counts the gold leaves an output matches exactly at the same JSON Pointer
(bench/strategies.py field_accuracy; a truncated or failed result matches none). For the
calibration, every leaf of a schema-valid result is graded against the gold at its pointer
(a leaf the gold lacks is wrong) and put in a bucket by its confidence: the minimum
probability of the tokens that wrote it (engine/grounding.py). Each run writes
`quality-<model>.json` into --out, then prints the model table and the calibration tables of
every such file there and plots them into `calibration.png` (accuracy against confidence,
one line per model and dataset, the diagonal for reference).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.contacts import contacts
from bench.receipts import receipt_rows
from bench.strategies import leaves, load_dataset, results_accuracy, write_report
from structspec.config import Settings
from structspec.engine.engine import Engine, Request
from structspec.engine.model import load_model
from structspec.options import RequestOptions

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
# Upper edges of the confidence buckets; a confidence equal to an edge falls in the bucket below.
EDGES = (0.5, 0.8, 0.95, 0.99, 1.0)


def bucket_of(confidence: float) -> int:
    return next(i for i, edge in enumerate(EDGES) if confidence <= edge)


def grade(results, rows) -> dict:
    """Per bucket: values, correct ones, mean confidence; plus result counts."""
    buckets = [{"values": 0, "correct": 0, "confidence_sum": 0.0} for _ in EDGES]
    for res, row in zip(results, rows):
        if res.status != "succeeded" or not res.confidence:
            continue
        gold, have = leaves(row["gold"]), leaves(res.value)
        for ptr, conf in res.confidence.items():
            if ptr not in have:
                continue
            b = buckets[bucket_of(conf["min"])]
            b["values"] += 1
            b["correct"] += int(gold.get(ptr) == have[ptr])
            b["confidence_sum"] += conf["min"]
    return {"documents": len(rows), "valid": sum(r.status == "succeeded" for r in results),
            "buckets": [{"upper": edge, **b} for edge, b in zip(EDGES, buckets)]}


def table(label: str, graded: dict) -> str:
    lines = [f"{label}: {graded['valid']}/{graded['documents']} schema-valid results graded",
             "", "| confidence (min token probability) | values | mean confidence | field accuracy |",
             "|---|---|---|---|"]
    lower = 0.0
    for b in graded["buckets"]:
        n = b["values"]
        mean = f"{b['confidence_sum'] / n:.3f}" if n else "-"
        acc = f"{b['correct'] / n:.1%} ({b['correct']}/{n})" if n else "-"
        lines.append(f"| ({lower:g}, {b['upper']:g}] | {n} | {mean} | {acc} |")
        lower = b["upper"]
    return "\n".join(lines)


def plot(report: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfectly calibrated")
    for label, graded in report.items():
        pts = [(b["confidence_sum"] / b["values"], b["correct"] / b["values"], b["values"])
               for b in graded["buckets"] if b["values"]]
        if pts:
            xs, ys, _ = zip(*pts)
            ax.plot(xs, ys, marker="o", label=label)
            for x, y, n in pts:
                ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
    ax.set_xlabel("mean confidence in bucket (min token probability)")
    ax.set_ylabel("field accuracy in bucket")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.set_title("Confidence calibration, greedy (point labels: values per bucket)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_model(model: str, args) -> dict:
    settings = Settings.from_env(model=model)
    loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype, cache_dir=settings.cache_dir)
    engine = Engine(loaded, settings, engine_confidence=True)
    contact = json.loads((SCHEMAS / "contact.json").read_text())
    sets = {"synthetic e-mails": [{**r, "schema": contact} for r in contacts(args.emails, seed=23)],
            "synthetic receipts": receipt_rows(args.receipts, seed=23)}
    if Path(args.dataset).exists():
        sets["DeepJSONEval"] = load_dataset(args.dataset, args.limit, args.max_chars)
    else:
        print(f"{args.dataset} not found: DeepJSONEval skipped")
    opts = RequestOptions(strategy="none", max_tokens=args.max_tokens)
    report = {}
    for label, rows in sets.items():
        start = time.perf_counter()
        results = engine.run([Request(r["schema"], r["text"], opts) for r in rows])
        matched, total = results_accuracy(results, rows)
        report[label] = {**grade(results, rows), "gold_matched": matched, "gold_fields": total,
                         "output_tokens": sum(len(r.tokens) for r in results),
                         "seconds": round(time.perf_counter() - start, 1)}
    name = "SmolLM2-135M-Instruct (default)" if model == "default" else Path(model).name
    return {"model": name, "max_tokens": args.max_tokens, "sets": report}


def model_table(runs: list[dict]) -> str:
    lines = ["| model | documents | schema-valid | field accuracy | output tokens |", "|---|---|---|---|---|"]
    for run in runs:
        for label, g in run["sets"].items():
            acc = g["gold_matched"] / g["gold_fields"] if g["gold_fields"] else 0.0
            lines.append(f"| {run['model']} | {label} ({g['documents']}) | {g['valid']}/{g['documents']} | "
                         f"{acc:.1%} | {g['output_tokens']} |")
    return "\n".join(lines)


def slug(model: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in Path(model).name or model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="as structspec extract --model")
    p.add_argument("--dataset", default="../shared/data/deepjsoneval_en.jsonl")
    p.add_argument("--limit", type=int, default=48, help="DeepJSONEval documents")
    p.add_argument("--max-chars", type=int, default=4500)
    p.add_argument("--receipts", type=int, default=32, help="synthetic receipts")
    p.add_argument("--emails", type=int, default=32, help="synthetic e-mails (contact schema)")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--out", default="bench-out")
    p.add_argument("--report-only", action="store_true", help="decode nothing; tabulate and plot the files in --out")
    args = p.parse_args(argv)
    if not args.report_only:
        write_report(args.out, f"quality-{slug(args.model)}.json", run_model(args.model, args))
    runs = [json.loads(f.read_text()) for f in sorted(Path(args.out).glob("quality-*.json"))]
    print(model_table(runs) + "\n")
    for run in runs:
        for label, g in run["sets"].items():
            print(table(f"{run['model']}, {label}", g) + "\n")
    curves = {f"{run['model']}: {label}": g for run in runs for label, g in run["sets"].items()}
    plot(curves, Path(args.out) / "calibration.png")
    print(f"wrote {Path(args.out) / 'calibration.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
