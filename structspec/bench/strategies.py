"""Drafting strategies compared on one dataset, interleaved per document in one run.

The machine is noisy, so every figure that matters is a ratio against `none` measured
on the same documents in the same run. Each speculative output is also checked to be
token-identical to `none` (greedy), which is the engine's core promise.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

from structspec.engine.engine import Engine, ExtractOptions
from structspec.engine.proposers import STRATEGIES
from structspec.engine.prompt import DocumentTooLong


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


def summarize(records: list[dict], strategy: str) -> dict:
    mine = [r for r in records if r["strategy"] == strategy]
    base = {r["id"]: r for r in records if r["strategy"] == "none"}
    out_tokens = sum(r["output_tokens"] for r in mine)
    passes = sum(r["target_passes"] for r in mine)
    proposed = sum(r["proposed"] for r in mine)
    accepted = sum(r["accepted"] for r in mine)
    decode_s = sum(r["decode_s"] for r in mine)
    base_decode = sum(base[r["id"]]["decode_s"] for r in mine if r["id"] in base)
    identical = sum(1 for r in mine if r["id"] in base and r["tokens"] == base[r["id"]]["tokens"])
    per_doc_tpp = [r["tokens_per_pass"] for r in mine if r["target_passes"]]
    return {
        "strategy": strategy,
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
    }


def markdown_table(summaries: list[dict]) -> str:
    head = ("| strategy | docs | succeeded | truncated | identical to none | tokens/pass (all) | "
            "tokens/pass (doc mean) | acceptance | decode tok/s | decode s | speedup vs none |")
    lines = [head, "|" + "---|" * 11]
    for s in summaries:
        lines.append(
            f"| {s['strategy']} | {s['documents']} | {s['succeeded']} | {s['truncated']} | "
            f"{s['identical_to_none']}/{s['documents']} | {s['tokens_per_pass']:.2f} | "
            f"{s['mean_doc_tokens_per_pass']:.2f} | {s['acceptance_rate']:.1%} | {s['decode_tok_s']:.1f} | "
            f"{s['decode_s']:.1f} | {s['speedup_vs_none']:.2f}x |")
    return "\n".join(lines)


def run_strategy_bench(args, engine: Engine) -> int:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        print(f"structspec: error: unknown strategies {unknown}; choose from {list(STRATEGIES)}", file=sys.stderr)
        return 2
    if "none" not in strategies:
        strategies.insert(0, "none")  # the baseline every ratio needs
    try:
        rows = load_dataset(args.dataset, args.limit, args.max_chars)
    except (OSError, ValueError) as e:
        print(f"structspec: error: {e}", file=sys.stderr)
        return 2
    records: list[dict] = []
    engine.decoder.memo_prefill = True  # every strategy of a document shares one prefill
    t0 = time.perf_counter()
    with tqdm(total=len(rows) * len(strategies), desc="bench", unit="run", file=sys.stderr) as bar:
        for row in rows:
            for strategy in strategies:  # interleaved: noise hits every strategy alike
                opts = ExtractOptions(strategy=strategy, draft_len=args.draft_len, max_tokens=args.max_tokens)
                try:
                    res = engine.extract(row["schema"], row["text"], opts)
                except DocumentTooLong as e:
                    bar.write(f"skip {row.get('id')}: {e}")
                    bar.update(len(strategies))
                    break
                records.append({"id": row.get("id"), "strategy": strategy, "status": res.status,
                                "tokens": res.tokens, **res.stats.as_dict()})
                bar.update(1)
    summaries = [summarize(records, s) for s in strategies]
    print(f"model={engine.loaded.name} draft_len={args.draft_len} max_tokens={args.max_tokens} "
          f"documents={len({r['id'] for r in records})} wall={time.perf_counter() - t0:.0f}s")
    print(markdown_table(summaries))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "strategies.json").write_text(json.dumps({"summaries": summaries, "records": records}, indent=1))
        print(f"records written to {out / 'strategies.json'}")
    mismatches = [s["strategy"] for s in summaries if s["identical_to_none"] != s["documents"]]
    if mismatches:
        print(f"WARNING: outputs differ from none for {mismatches}", file=sys.stderr)
        return 1
    return 0
