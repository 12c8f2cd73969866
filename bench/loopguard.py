"""The loop guard's counting rule on and off: which outputs it ends, and what it costs.

    python -m bench.loopguard --counting on  --out bench-out/counting-on.json
    python -m bench.loopguard --counting off --out bench-out/counting-off.json
    python -m bench.loopguard --report bench-out/counting-off.json bench-out/counting-on.json

Greedy `none` on DeepJSONEval, synthetic receipts and synthetic e-mails with the contact schema
in free mode (no spans: where a counting string was seen), max_tokens 384, the identical rule
at its default either way. One document at a time (engine_max_seqs=1), so an output depends
on nothing but its document and the rule: the two runs are identical until the counting rule
ends one. The report lists every document whose output differs, with both outcomes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.contacts import contacts
from bench.receipts import receipt_rows
from bench.strategies import field_accuracy, load_dataset
from structspec.config import Settings
from structspec.engine.engine import Engine, Request
from structspec.engine.model import load_model
from structspec.options import RequestOptions

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


def documents(dataset: str, limit: int, max_chars: int, n_receipts: int, n_emails: int, seed: int = 11) -> list[dict]:
    contact = json.loads((SCHEMAS / "contact.json").read_text())
    contact.pop("x-structspec-verbatim", None)
    rows = [{**r, "set": "deepjsoneval"} for r in load_dataset(dataset, limit, max_chars)] if limit else []
    rows += [{**r, "set": "receipts", "id": f"receipt-{i}"} for i, r in enumerate(receipt_rows(n_receipts, seed=seed))]
    rows += [{**r, "schema": contact, "set": "e-mails (free)", "id": f"e-mail-{i}"}
             for i, r in enumerate(contacts(n_emails, seed=seed))]
    return rows


def run(args) -> dict:
    settings = Settings.from_env()
    loaded = load_model(args.model, device="cpu", cache_dir=settings.cache_dir)
    engine = Engine(loaded, kernel_backend="torch", engine_max_seqs=1, engine_confidence=False,
                    engine_loop_counting=args.counting == "on")
    rows = documents(args.dataset, args.limit, args.max_chars, args.receipts, args.emails, args.seed)
    opts = RequestOptions(strategy="none", draft_len=0, max_tokens=args.max_tokens)
    t = time.perf_counter()
    results = engine.run([Request(r["schema"], r["text"], opts) for r in rows])
    out = []
    for row, res in zip(rows, results):
        acc = field_accuracy(res.value, row.get("gold")) if res.status == "succeeded" and row.get("gold") else None
        out.append({"id": row["id"], "set": row["set"], "status": res.status, "stop": res.stats.stop_reason,
                    "error": res.error, "tokens": res.tokens, "matched": acc[0] if acc else 0,
                    "gold_fields": acc[1] if acc else None})
    return {"counting": args.counting, "model": args.model, "max_tokens": args.max_tokens,
            "seconds": round(time.perf_counter() - t, 1), "documents": out}


def report(off_path: str, on_path: str) -> str:
    off, on = (json.loads(Path(p).read_text()) for p in (off_path, on_path))
    lines = ["| set | documents | succeeded (off / on) | output tokens (off / on) | ended by the counting rule | "
             "of those, succeeded with it off |", "|---|---|---|---|---|---|"]
    changed = []
    for name in dict.fromkeys(d["set"] for d in off["documents"]):
        a = [d for d in off["documents"] if d["set"] == name]
        b = [d for d in on["documents"] if d["set"] == name]
        fired = [(x, y) for x, y in zip(a, b) if "inside one string" in (y["error"] or "")]
        lost = [x for x, _ in fired if x["status"] == "succeeded"]
        lines.append(f"| {name} | {len(a)} | {sum(d['status'] == 'succeeded' for d in a)} / "
                     f"{sum(d['status'] == 'succeeded' for d in b)} | {sum(len(d['tokens']) for d in a)} / "
                     f"{sum(len(d['tokens']) for d in b)} | {len(fired)} | {len(lost)} |")
        for x, y in zip(a, b):
            if x["tokens"] != y["tokens"]:
                prefix = y["tokens"] == x["tokens"][:len(y["tokens"])]
                changed.append(f"- {name} {x['id']}: off {x['status']} ({x['stop']}, {len(x['tokens'])} tokens); "
                               f"on {y['status']} ({y['stop']}, {len(y['tokens'])} tokens)"
                               f"{'' if prefix else ' NOT A PREFIX'}: {y['error']}")
    return "\n".join(lines + ["", "Documents whose output differs:", ""] + (changed or ["- none"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loopguard", description=__doc__.split("\n\n")[0])
    p.add_argument("--counting", choices=["on", "off"], default="on")
    p.add_argument("--model", default="default")
    p.add_argument("--dataset", default="../shared/data/deepjsoneval_en.jsonl")
    p.add_argument("--limit", type=int, default=24, help="DeepJSONEval documents")
    p.add_argument("--max-chars", type=int, default=4500)
    p.add_argument("--receipts", type=int, default=16)
    p.add_argument("--emails", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--seed", type=int, default=11, help="of the synthetic receipts and e-mails")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON file for this run")
    p.add_argument("--report", nargs=2, metavar=("OFF.json", "ON.json"), help="compare two runs; decode nothing")
    args = p.parse_args(argv)
    if args.report:
        print(report(*args.report))
        return 0
    import torch

    torch.set_num_threads(args.threads)
    result = run(args)
    path = Path(args.out or f"bench-out/counting-{args.counting}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    print(f"{path}: {len(result['documents'])} documents in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
