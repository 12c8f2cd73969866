"""The suffix proposer's memory of earlier outputs, on and off, side by side (`make bench-suffix`).

    python -m bench.suffix [--n 32] [--repeats 1] [--modes "batch auto"] [--deepjsoneval PATH --deepjsoneval-n 32]
                                      [--out bench-out/suffix.json]

Through a real `structspec serve` + `structspec worker` (bench/load.py's Service: SQLite, the
embedded broker, default settings), once with STRUCTSPEC_ENGINE_SUFFIX_MB=0 (off) and once
with the default (on), the same held-out receipts as `make bench-peer` (bench/receipts.py, the
first --n of seed 0; the next 8 warm `auto` up, as bench-peer does). In each service, three
schema versions of their own (so neither the statistics nor the memory are shared):

- `cold composite`: strategy composite k=8, one document after another, from a cold memory:
  tokens per pass of documents 1..n in order (the warm-up curve);
- `one auto`: the 8 warm-up receipts, then the n one after another with default options;
- `batch auto`: the 8 warm-up receipts one at a time, then the n as one POST /v1/batches.

Each row: documents/min (first POST to last result), tokens per pass (output tokens / target
passes over the timed documents) and the strategies `auto` ran. With --deepjsoneval, the
engine in this process on that file's shortest documents (each its own schema, so the memory
can help little), composite k=8 one at a time, the memory on and off alternating per document.

This is a benchmark, not a test: run it alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from bench.peer import WARMUP
from bench.receipts import receipt_rows

WARM_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
COMPOSITE = {"strategy": "composite", "draft_len": 8, "max_tokens": 256}
AUTO = {"max_tokens": 256}


def say(msg: str) -> None:
    print(f"bench suffix: {msg}", file=sys.stderr, flush=True)


def summary(jobs: list[dict], seconds: float) -> dict:
    stats = [j.get("stats") or {} for j in jobs]
    tokens = sum(s.get("output_tokens", 0) for s in stats)
    passes = sum(s.get("target_passes", 0) for s in stats)
    return {"docs": len(jobs), "succeeded": sum(j.get("status") == "succeeded" for j in jobs),
            "seconds": round(seconds, 2), "docs_per_min": round(len(jobs) / seconds * 60, 1),
            "tokens_per_pass": round(tokens / passes, 3) if passes else 0.0,
            "curve": [round(s.get("tokens_per_pass", 0.0), 2) for s in stats],
            "arms": dict(Counter(f"{s.get('strategy')} k={s.get('draft_len')}" for s in stats))}


MODES = ("cold composite", "one auto", "batch auto")


def server_run(memory: bool, rows: list[dict], warm: list[dict], threads: int | None,
               modes: tuple[str, ...] = MODES) -> dict:
    from bench.batch import run_batch
    from bench.load import Service

    env = {} if memory else {"STRUCTSPEC_ENGINE_SUFFIX_MB": "0"}
    label = "on" if memory else "off"
    out = {}
    with Service(threads=threads, env=env, connections=len(rows) + 4,
                 say=lambda m: say(f"memory {label}: {m}")) as svc:
        def register(name: str, schema: dict) -> str:
            r = svc.http.post("/v1/schemas", json={"name": name, "schema": schema})
            r.raise_for_status()
            return r.json()["id"]

        svc.run_one(register("warm", WARM_SCHEMA), "ok: yes", {"max_tokens": 16})  # loads the model
        texts = [row["text"] for row in rows]
        schema = rows[0]["schema"]
        one_by_one = lambda sid, options: [svc.run_one(sid, d, options) for d in texts]  # noqa: E731
        as_batch = lambda sid, options: sorted(run_batch(svc, sid, texts, options)["results"],  # noqa: E731
                                               key=lambda x: x["id"])
        for mode, name, options, warmed, run in (("cold composite", "cold", COMPOSITE, [], one_by_one),
                                                 ("one auto", "one", AUTO, warm, one_by_one),
                                                 ("batch auto", "batch", AUTO, warm, as_batch)):
            if mode not in modes:
                continue
            schema_id = register(name, schema)  # a schema version of its own: no statistics or memory shared
            for row in warmed:
                svc.run_one(schema_id, row["text"], options)
            t = time.perf_counter()
            out[mode] = summary(run(schema_id, options), time.perf_counter() - t)
            say(f"memory {label}, {mode}: {out[mode]['docs_per_min']} docs/min")
    return out


def deepjsoneval_run(path: str, n: int) -> dict:
    """Composite k=8 one at a time, the memory on and off alternating per document (one engine;
    each document's schema is its own key)."""
    from bench.strategies import load_dataset
    from structspec.config import Settings
    from structspec.engine.engine import Engine
    from structspec.grammar import schema_hash
    from structspec.options import RequestOptions

    rows = sorted(load_dataset(path, 10**9, 4500), key=lambda r: len(r["text"]))[:n]
    engine = Engine.from_settings(Settings.from_env(engine_max_seqs=1))
    memory = engine.histories
    opts = RequestOptions(strategy="composite", draft_len=8, max_tokens=192)
    engine.extract(rows[0]["schema"], rows[0]["text"], opts)  # warm-up
    seconds = {True: 0.0, False: 0.0}
    tokens = {True: 0, False: 0}
    passes = {True: 0, False: 0}
    for i, row in enumerate(rows):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            engine.histories = memory if on else None
            t = time.perf_counter()
            res = engine.extract(row["schema"], row["text"], opts, history=f"bench/{schema_hash(row['schema'])}")
            seconds[on] += time.perf_counter() - t
            tokens[on] += res.stats.output_tokens
            passes[on] += res.stats.target_passes
    engine.histories = memory
    return {label: {"docs": len(rows), "seconds": round(seconds[on], 2),
                    "docs_per_min": round(len(rows) / seconds[on] * 60, 1),
                    "tokens_per_pass": round(tokens[on] / max(1, passes[on]), 3)}
            for label, on in (("on", True), ("off", False))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.suffix", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=32, help="timed receipts per mode")
    p.add_argument("--repeats", type=int, default=1, help="off/on pairs of services (off, on, off, on, ...)")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the worker (default: its own)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of: {', '.join(MODES)} (default: all)")
    p.add_argument("--deepjsoneval", default="", help="also the engine on this JSONL's shortest documents")
    p.add_argument("--deepjsoneval-n", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("bench-out/suffix.json"))
    args = p.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        p.error(f"--modes: unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    rows = receipt_rows(args.n + WARMUP)
    timed, warm = rows[:args.n], rows[args.n:]
    report: dict = {"receipts": {"off": [], "on": []}}
    for _ in range(args.repeats):
        for memory in (False, True):
            report["receipts"]["on" if memory else "off"].append(server_run(memory, timed, warm, args.threads, modes))
    if args.deepjsoneval:
        report["deepjsoneval"] = deepjsoneval_run(args.deepjsoneval, args.deepjsoneval_n)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print_report(report)
    return 0


def print_report(report: dict) -> None:
    rec = report["receipts"]
    print("| mode | memory | docs/min | tokens/pass | succeeded | arms |")
    print("|---|---|---:|---:|---:|---|")
    modes = [m for m in MODES if m in rec["off"][0]]
    for mode in modes:
        for label in ("off", "on"):
            for run in rec[label]:
                r = run[mode]
                print(f"| {mode} | {label} | {r['docs_per_min']} | {r['tokens_per_pass']} | {r['succeeded']}/{r['docs']} "
                      f"| {', '.join(f'{k} x{v}' for k, v in sorted(r['arms'].items()))} |")
        on = [run[mode] for run in rec["on"]]
        off = [run[mode] for run in rec["off"]]
        ratio = sum(r["docs_per_min"] for r in on) / sum(r["docs_per_min"] for r in off)
        tpp = sum(r["tokens_per_pass"] for r in on) / sum(r["tokens_per_pass"] for r in off)
        print(f"| {mode} | on / off | {ratio:.2f}x | {tpp:.2f}x | | |")
    if "cold composite" in modes:
        off_composite = sum(run["cold composite"]["tokens_per_pass"] for run in rec["off"]) / len(rec["off"])
        for run in rec["on"]:
            if "one auto" in run:
                print(f"\none auto (memory on) tokens/pass vs composite with the memory off: "
                      f"{run['one auto']['tokens_per_pass'] / off_composite:.2f}x")
            print(f"warm-up curve (cold composite, memory on), tokens/pass of documents 1..n: "
                  f"{run['cold composite']['curve']}")
    if "deepjsoneval" in report:
        d = report["deepjsoneval"]
        print(f"\nDeepJSONEval, composite k=8 one at a time: memory on {d['on']['docs_per_min']} docs/min "
              f"({d['on']['tokens_per_pass']} tokens/pass), off {d['off']['docs_per_min']} "
              f"({d['off']['tokens_per_pass']}): {d['on']['docs_per_min'] / d['off']['docs_per_min']:.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
