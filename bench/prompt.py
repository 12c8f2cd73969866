"""The extraction prompt's layout, measured: the schema as the field list the engine uses
(engine/prompt.py) against the raw JSON Schema, and the field list after one worked example
(a user turn with another schema and document, and the assistant's JSON), on DeepJSONEval and
on synthetic receipts with gold values, default model, greedy `none` (the grammar enforces the
schema either way; the prompt only steers the model). One process, the documents of each
variant batched.

    python -m bench.prompt [--dataset ../shared/data/deepjsoneval_en.jsonl] [--limit 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import structspec.engine.prompt as prompt
from bench.receipts import receipt_rows
from bench.strategies import load_dataset, results_accuracy
from structspec.config import Settings
from structspec.engine.engine import Engine, Request
from structspec.engine.model import load_model
from structspec.options import RequestOptions


def raw_schema_messages(schema: dict, document: str) -> list[dict[str, str]]:
    """The layout before the field list: the JSON Schema as compact JSON."""
    raw = f"JSON Schema:\n{json.dumps(schema, separators=(',', ':'), ensure_ascii=False)}\n\nDocument:\n{document}"
    return [{"role": "system", "content": prompt.SYSTEM_INSTRUCTION}, {"role": "user", "content": raw}]


DEFAULT = prompt.extraction_messages

# One worked example, its own schema, document and answer (invented for this benchmark).
EXAMPLE_SCHEMA = {"type": "object", "properties": {
    "sender": {"type": "string", "description": "Who sent the parcel"},
    "recipient": {"type": "string"},
    "shipped": {"type": "string", "description": "Date shipped, as printed"},
    "lines": {"type": "array", "items": {"type": "object", "properties": {
        "title": {"type": "string"}, "quantity": {"type": "integer"}}}},
    "total": {"type": "number", "description": "Amount charged"}}}
EXAMPLE_DOCUMENT = ("PARCEL DELIVERY NOTE\nAlder & Finch Books, 5 Mill Lane, York YO1 7PX\nDeliver to: Priya Raman\n"
                    "Shipped: 12 May 2023\n\n2 x Field Guide to Mosses      36.00\n1 x Pocket Atlas of Britain     9.50\n\n"
                    "Postage                         3.20\nTotal charged                  48.70\n")
EXAMPLE_ANSWER = {"sender": "Alder & Finch Books", "recipient": "Priya Raman", "shipped": "12 May 2023",
                  "lines": [{"title": "Field Guide to Mosses", "quantity": 2},
                            {"title": "Pocket Atlas of Britain", "quantity": 1}], "total": 48.7}


def worked_example_messages(schema: dict, document: str) -> list[dict[str, str]]:
    """The default messages with one worked example between instruction and request."""
    system, user = DEFAULT(schema, document)
    example = DEFAULT(EXAMPLE_SCHEMA, EXAMPLE_DOCUMENT)[1]
    return [system, example, {"role": "assistant", "content": json.dumps(EXAMPLE_ANSWER, ensure_ascii=False)}, user]


VARIANTS = {"raw JSON Schema": raw_schema_messages, "field list (default)": DEFAULT,
            "field list after one worked example": worked_example_messages}


def measure(loaded, settings: Settings, rows: list[dict], max_tokens: int) -> dict[str, dict]:
    out = {}
    for name, layout in VARIANTS.items():
        prompt.extraction_messages = layout
        try:
            engine = Engine(loaded, settings)
            results = engine.run([Request(r["schema"], r["text"], RequestOptions(strategy="none", max_tokens=max_tokens))
                                  for r in rows])
        finally:
            prompt.extraction_messages = DEFAULT
        matched, total = results_accuracy(results, rows)
        out[name] = {"valid": sum(r.status == "succeeded" for r in results), "documents": len(rows),
                     "accuracy": matched / total if total else None,
                     "output_tokens": sum(len(r.tokens) for r in results)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="../shared/data/deepjsoneval_en.jsonl")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-chars", type=int, default=4500)
    p.add_argument("--receipts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=384)
    args = p.parse_args(argv)
    settings = Settings.from_env()
    loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype, cache_dir=settings.cache_dir)
    sets = {"synthetic receipts": receipt_rows(args.receipts, seed=11)}
    if Path(args.dataset).exists():
        sets["DeepJSONEval"] = load_dataset(args.dataset, args.limit, args.max_chars)
    else:
        print(f"{args.dataset} not found: DeepJSONEval skipped")
    print("| documents | prompt | schema-valid | field accuracy | output tokens |\n|---|---|---|---|---|")
    for label, rows in sets.items():
        for name, m in measure(loaded, settings, rows, args.max_tokens).items():
            acc = f"{m['accuracy']:.1%}" if m["accuracy"] is not None else "-"
            print(f"| {label} ({m['documents']}) | {name} | {m['valid']}/{m['documents']} | {acc} | "
                  f"{m['output_tokens']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
