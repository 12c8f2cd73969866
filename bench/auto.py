"""`python -m bench.auto`: `auto` against every fixed (strategy, k) arm it can choose, on one dataset, in one run.

Warm-up: the first `--warmup` documents run with `auto` alone, so the selector learns from
its own traffic as it would in the service. Then every measured document runs `none`, every
fixed arm of the grid and `auto`, interleaved per document so the machine's noise hits them
alike. `auto` keeps learning during the measured documents; the fixed arms never feed it.

The selector's statistics are pooled under one key for the whole dataset. DeepJSONEval gives
every document a schema of its own, so per-schema pooling would never get past the first
request; one key for the set is the traffic of one user with one family of schemas. Greedy
output is token-identical across arms (checked), so tokens/s ratios are decode-time ratios.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

from tqdm import tqdm

from bench.strategies import load_dataset, write_report
from structspec.cli import add_model_args, build_engine, settings_from
from structspec.engine.engine import Engine
from structspec.engine.prompt import DocumentTooLong
from structspec.options import RequestOptions
from structspec.stats.aggregate import InMemoryStats
from structspec.stats.selector import PROPOSING, Selector, SelectorConfig

AUTO = "auto"


def arm_name(strategy: str | None, draft_len: int | None) -> str:
    """How every report spells an arm: `none` (or `auto`) alone, a proposing one as `schema:8`."""
    return str(strategy) if strategy in ("none", AUTO, None) else f"{strategy}:{draft_len}"


def summarize(records: list[dict], arm: str) -> dict:
    mine = [r for r in records if r["arm"] == arm]
    tokens = sum(r["output_tokens"] for r in mine)
    passes = sum(r["target_passes"] for r in mine)
    decode_s = sum(r["decode_s"] for r in mine)
    return {"arm": arm, "documents": len(mine), "output_tokens": tokens, "target_passes": passes,
            "tokens_per_pass": tokens / passes if passes else 0.0, "decode_s": decode_s,
            "decode_tok_s": tokens / decode_s if decode_s else 0.0,
            "identical_to_none": sum(r["identical_to_none"] for r in mine)}


def report(summaries: list[dict], choices: Counter) -> tuple[str, dict]:
    fixed = [s for s in summaries if s["arm"] != AUTO]
    auto = next(s for s in summaries if s["arm"] == AUTO)
    best = max(fixed, key=lambda s: s["decode_tok_s"])
    worst = min(fixed, key=lambda s: s["decode_tok_s"])
    verdict = {"best_fixed": best["arm"], "worst_fixed": worst["arm"],
               "auto_vs_best": auto["decode_tok_s"] / best["decode_tok_s"] if best["decode_tok_s"] else 0.0,
               "auto_vs_worst": auto["decode_tok_s"] / worst["decode_tok_s"] if worst["decode_tok_s"] else 0.0,
               "auto_choices": dict(choices.most_common())}
    lines = ["| arm | docs | identical to none | tokens/pass | decode tok/s | decode s | vs best fixed |",
             "|---|---|---|---|---|---|---|"]
    for s in sorted(summaries, key=lambda s: -s["decode_tok_s"]):
        ratio = s["decode_tok_s"] / best["decode_tok_s"] if best["decode_tok_s"] else 0.0
        lines.append(f"| {s['arm']} | {s['documents']} | {s['identical_to_none']}/{s['documents']} | "
                     f"{s['tokens_per_pass']:.2f} | {s['decode_tok_s']:.1f} | {s['decode_s']:.1f} | {ratio:.3f} |")
    lines.append("")
    lines.append(f"auto = {verdict['auto_vs_best']:.3f} x best fixed ({best['arm']}), "
                 f"{verdict['auto_vs_worst']:.2f} x worst fixed ({worst['arm']}); "
                 f"auto's choices on measured documents: "
                 + ", ".join(f"{k} {v}" for k, v in choices.most_common()))
    return "\n".join(lines), verdict


def run_auto_bench(args, engine: Engine) -> int:
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in PROPOSING]
    try:
        draft_lens = sorted({int(k) for k in args.draft_lens.split(",") if k.strip()})
    except ValueError:
        draft_lens = []
    if bad or not strategies or not draft_lens or min(draft_lens) < 1:
        print(f"structspec: error: --strategies takes some of {list(PROPOSING)} and --draft-lens "
              f"positive integers (got {args.strategies!r}, {args.draft_lens!r})", file=sys.stderr)
        return 2
    try:
        rows = load_dataset(args.dataset, args.warmup + args.limit, args.max_chars)
    except (OSError, ValueError) as e:
        print(f"structspec: error: {e}", file=sys.stderr)
        return 2
    fixed = [("none", 0)] + [(s, k) for s in strategies for k in draft_lens]
    selector = Selector(SelectorConfig(strategies=tuple(strategies), draft_lens=tuple(draft_lens)))
    stats = InMemoryStats(args.half_life)
    rng = random.Random(args.seed)
    records: list[dict] = []
    choices: Counter = Counter()
    warm, measured = rows[:args.warmup], rows[args.warmup:]
    t0 = time.perf_counter()

    def run(row, strategy: str, k: int):
        return engine.extract(row["schema"], row["text"],  # every arm of a document shares one prefill
                              RequestOptions(strategy=strategy, draft_len=k, max_tokens=args.max_tokens,
                                             verbatim=args.verbatim), reuse_prompt=True)

    def run_auto(row):
        choice = selector.choose(stats.views(args.verbatim), rng)
        res = run(row, choice.strategy, choice.draft_len)
        stats.record(res.stats.as_dict())
        return res, arm_name(choice.strategy, choice.draft_len)

    total = len(warm) + len(measured) * (len(fixed) + 1)
    with tqdm(total=total, desc="bench auto", unit="run", file=sys.stderr) as bar:
        for row in warm:
            try:
                _, picked = run_auto(row)
                bar.set_postfix_str(f"warm-up: {picked}")
            except DocumentTooLong as e:
                bar.write(f"skip {row.get('id')}: {e}")
            bar.update(1)
        for row in measured:
            runs = fixed + [(AUTO, 0)]
            try:
                base = None
                for strategy, k in runs:  # interleaved per document
                    if strategy == AUTO:
                        res, picked = run_auto(row)
                        choices[picked] += 1
                    else:
                        res = run(row, strategy, k)
                    base = res.tokens if base is None else base
                    records.append({"id": row.get("id"), "arm": arm_name(strategy, k), "status": res.status,
                                    "identical_to_none": res.tokens == base, "tokens": res.tokens,
                                    **res.stats.as_dict()})
                    bar.update(1)
            except DocumentTooLong as e:
                bar.write(f"skip {row.get('id')}: {e}")
                records = [r for r in records if r["id"] != row.get("id")]
                bar.update(len(runs))
    arms = [arm_name(s, k) for s, k in fixed] + [AUTO]
    summaries = [summarize(records, a) for a in arms]
    table, verdict = report(summaries, choices)
    docs = len({r["id"] for r in records})
    print(f"model={engine.loaded.name} max_tokens={args.max_tokens} warm-up={len(warm)} measured={docs} "
          f"wall={time.perf_counter() - t0:.0f}s")
    print(table)
    if args.out:
        path = write_report(args.out, "auto.json", {"summaries": summaries, "verdict": verdict, "records": records})
        print(f"records written to {path}")
    if any(s["identical_to_none"] != s["documents"] for s in summaries):
        print("WARNING: some outputs differ from none", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from structspec.config import Settings

    defaults = Settings.from_env()
    p = argparse.ArgumentParser(prog="python -m bench.auto",
                                description="The auto selector against every fixed (strategy, k) arm it chooses "
                                            "from. Warm the selector up on the first --warmup documents (auto "
                                            "alone), then run none, every fixed arm and auto interleaved on the "
                                            "next --limit documents and compare decode throughput. Statistics are "
                                            "pooled for the whole dataset.")
    p.add_argument("--dataset", required=True, help="JSONL with {id, schema, text, gold?} per line")
    p.add_argument("--warmup", type=int, default=8, help="documents run with auto alone first")
    p.add_argument("--limit", type=int, default=10, help="measured documents after the warm-up")
    p.add_argument("--strategies", default="schema,ngram,composite", help="proposers in the grid")
    p.add_argument("--draft-lens", default="2,4,8,12", help="draft lengths in the grid")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-chars", type=int, default=0, help="skip documents longer than this (0 = no limit)")
    p.add_argument("--half-life", type=float, default=defaults.stats_half_life,
                   help="selector decay, in requests [env STRUCTSPEC_STATS_HALF_LIFE]")
    p.add_argument("--seed", type=int, default=0, help="seeds auto's Thompson draws")
    p.add_argument("--verbatim", action="store_true", help="every run in verbatim mode")
    p.add_argument("--out", help="write per-document records (JSON) here")
    add_model_args(p)
    args = p.parse_args(argv)
    return run_auto_bench(args, build_engine(settings_from(args)))


if __name__ == "__main__":
    sys.exit(main())
