"""`python -m bench.strategies`: drafting strategies compared on one dataset, interleaved per document in one run.

The machine is noisy, so every figure that matters is a ratio against `none` measured
on the same documents in the same run. Each speculative output is also checked to be
token-identical to `none` (greedy) of the same mode, which is the engine's core promise.
With `--modes free,verbatim` every strategy also runs in verbatim mode (string fields are
spans of the document), and field accuracy against the dataset's `gold` shows what that buys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from structspec.cli import add_model_args, build_engine, settings_from
from structspec.engine import grounding
from structspec.engine.engine import Engine
from structspec.engine.prompt import DocumentTooLong
from structspec.options import STRATEGIES, RequestOptions


def load_dataset(path: str, limit: int, max_chars: int = 0) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("schema"), dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"{path}:{line_no}: each line needs an object 'schema' and a string 'text'")
            if max_chars and len(row["text"]) > max_chars:
                continue
            rows.append(row)
            if len(rows) >= limit:
                break
    return rows


def write_report(out_dir: str, filename: str, payload: dict) -> Path:
    """`payload` as indented JSON in `out_dir` (created if needed); the file's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / filename).write_text(json.dumps(payload, indent=1))
    return out / filename


def leaves(value) -> dict[str, tuple]:
    """(kind, value) of every leaf by JSON Pointer; strings with whitespace runs collapsed,
    numbers as floats (1 == 1.0, but never == true)."""
    return {ptr: comparable(v) for ptr, v in grounding.leaves(value)}


def comparable(leaf) -> tuple:
    if isinstance(leaf, str):
        return ("string", " ".join(leaf.split()))
    if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
        return ("number", float(leaf))
    return (type(leaf).__name__, leaf)


def field_accuracy(value, gold) -> tuple[int, int]:
    """(gold leaves matched exactly by the output at the same path, gold leaves)."""
    want = leaves(gold)
    have = leaves(value) if value is not None else {}
    return sum(1 for p, v in want.items() if p in have and have[p] == v), len(want)


def results_accuracy(results, rows: list[dict]) -> tuple[int, int]:
    """field_accuracy summed over the rows that carry gold: a result that did not succeed
    matches none of its gold leaves."""
    matched = total = 0
    for row, res in zip(rows, results):
        if row.get("gold") is not None:
            m, n = field_accuracy(res.value if res.status == "succeeded" else None, row["gold"])
            matched, total = matched + m, total + n
    return matched, total


def system_name(strategy: str, verbatim: bool) -> str:
    return strategy + ("+verbatim" if verbatim else "")


def summarize(records: list[dict], system: str) -> dict:
    mine = [r for r in records if r["system"] == system]
    verbatim = system.endswith("+verbatim")
    base = {r["id"]: r for r in records if r["system"] == system_name("none", verbatim)}
    out_tokens = sum(r["output_tokens"] for r in mine)
    passes = sum(r["target_passes"] for r in mine)
    proposed = sum(r["proposed"] for r in mine)
    accepted = sum(r["accepted"] for r in mine)
    decode_s = sum(r["decode_s"] for r in mine)
    base_decode = sum(base[r["id"]]["decode_s"] for r in mine if r["id"] in base)
    identical = sum(1 for r in mine if r["id"] in base and r["tokens"] == base[r["id"]]["tokens"])
    per_doc_tpp = [r["tokens_per_pass"] for r in mine if r["target_passes"]]
    graded = [r for r in mine if r.get("gold_fields")]
    return {
        "system": system,
        "documents": len(mine),
        "succeeded": sum(r["status"] == "succeeded" for r in mine),
        "truncated": sum(r["status"] == "truncated" for r in mine),
        "identical_to_none": identical,
        "output_tokens": out_tokens,
        "target_passes": passes,
        "tokens_per_pass": out_tokens / passes if passes else 0.0,
        "mean_doc_tokens_per_pass": statistics.fmean(per_doc_tpp) if per_doc_tpp else 0.0,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "decode_tok_s": out_tokens / decode_s if decode_s else 0.0,
        "decode_s": decode_s,
        "speedup_vs_none": base_decode / decode_s if decode_s else 0.0,
        "field_accuracy": (sum(r["gold_matched"] for r in graded) / sum(r["gold_fields"] for r in graded)
                           if graded else None),
    }


def markdown_table(summaries: list[dict]) -> str:
    head = ("| system | docs | succeeded | hit max_tokens | identical to none | field accuracy | tokens/pass (all) | "
            "tokens/pass (doc mean) | acceptance | decode tok/s | decode s | speedup vs none |")
    lines = [head, "|" + "---|" * 12]
    for s in summaries:
        acc = "n/a" if s["field_accuracy"] is None else f"{s['field_accuracy']:.1%}"
        lines.append(
            f"| {s['system']} | {s['documents']} | {s['succeeded']} | {s['truncated']} | "
            f"{s['identical_to_none']}/{s['documents']} | {acc} | {s['tokens_per_pass']:.2f} | "
            f"{s['mean_doc_tokens_per_pass']:.2f} | {s['acceptance_rate']:.1%} | {s['decode_tok_s']:.1f} | "
            f"{s['decode_s']:.1f} | {s['speedup_vs_none']:.2f}x |")
    return "\n".join(lines)


def run_strategy_bench(args, engine: Engine) -> int:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown or not modes or set(modes) - {"free", "verbatim"}:
        print(f"structspec: error: --strategies takes some of {list(STRATEGIES)} (got {args.strategies!r}) and "
              f"--modes some of free,verbatim (got {args.modes!r})", file=sys.stderr)
        return 2
    if "none" not in strategies:
        strategies.insert(0, "none")  # the baseline every ratio needs
    systems = [(s, m == "verbatim") for m in modes for s in strategies]
    try:
        rows = load_dataset(args.dataset, args.limit, args.max_chars)
    except (OSError, ValueError) as e:
        print(f"structspec: error: {e}", file=sys.stderr)
        return 2
    records: list[dict] = []
    t0 = time.perf_counter()
    with tqdm(total=len(rows) * len(systems), desc="bench", unit="run", file=sys.stderr) as bar:
        for row in rows:
            for strategy, verbatim in systems:  # interleaved: noise hits every system alike
                opts = RequestOptions(strategy=strategy, draft_len=args.draft_len, max_tokens=args.max_tokens,
                                      verbatim=verbatim)
                try:  # every strategy of a document shares one prefill (decode time is compared)
                    res = engine.extract(row["schema"], row["text"], opts, reuse_prompt=True)
                except DocumentTooLong as e:
                    bar.write(f"skip {row.get('id')}: {e}")
                    bar.update(len(systems))
                    break
                matched, fields = field_accuracy(res.value, row["gold"]) if "gold" in row else (0, 0)
                records.append({"id": row.get("id"), "system": system_name(strategy, verbatim), "strategy": strategy,
                                "status": res.status, "gold_matched": matched, "gold_fields": fields,
                                "tokens": res.tokens, **res.stats.as_dict()})
                bar.update(1)
    summaries = [summarize(records, system_name(s, v)) for s, v in systems]
    print(f"model={engine.loaded.name} draft_len={args.draft_len} max_tokens={args.max_tokens} "
          f"documents={len({r['id'] for r in records})} wall={time.perf_counter() - t0:.0f}s")
    print(markdown_table(summaries))
    if args.out:
        path = write_report(args.out, "strategies.json", {"summaries": summaries, "records": records})
        print(f"records written to {path}")
    mismatches = [s["system"] for s in summaries if s["identical_to_none"] != s["documents"]]
    if mismatches:
        print(f"WARNING: outputs differ from none for {mismatches}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from structspec.config import Settings

    defaults = Settings.from_env()
    p = argparse.ArgumentParser(prog="python -m bench.strategies",
                                description="Compare drafting strategies on a JSONL dataset.")
    p.add_argument("--dataset", required=True, help="JSONL with {id, schema, text, gold?} per line")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--strategies", default="none,schema,ngram,composite")
    p.add_argument("--modes", default="free", help="free, verbatim or both (free,verbatim): each strategy in each mode")
    p.add_argument("--draft-len", type=int, default=defaults.draft_len, metavar="K")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-chars", type=int, default=0, help="skip documents longer than this (0 = no limit)")
    p.add_argument("--out", help="write per-document records (JSON) here")
    add_model_args(p)
    args = p.parse_args(argv)
    return run_strategy_bench(args, build_engine(settings_from(args)))


if __name__ == "__main__":
    sys.exit(main())
