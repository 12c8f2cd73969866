"""`python -m bench.batch`: the batched engine against one sequence at a time, in one run.

Parts (each a figure of the batched-engine issue; `--parts` picks some):

  a  DeepJSONEval, the shortest documents: output tokens/s of batched `auto` against `auto` at
     engine_max_seqs=1 and against batched `none`, end to end (wall clock of the whole run,
     prefill included) and decode only; configurations alternate between repeats.
  b  receipts through a real server + worker (bench/load.py's subprocesses): documents/min with
     the worker's STRUCTSPEC_ENGINE_MAX_SEQS=1 against its default.
  c  decode tokens/s against engine_max_seqs for `none` and `auto` on receipts: one engine whose
     prefix cache holds every prompt (Request.reuse_prompt), so no configuration pays prefill.
  d  the prefix cache (instruction + schema shared by one schema's documents): prefill seconds
     and tokens computed / reused, cache on against engine_prefix_cache_mb=0.
  e  engine overhead: the share of decode-step time outside the model's forward passes for
     batched `none`, and a cProfile of a short run.
  f  a KV budget that holds only a few sequences: every request completes, peak KV within the
     budget, the process's peak RSS.

`auto` here is the service's selector in process (bench/auto.py does the same): warmed up on
documents of its own, then every measured document's (strategy, k) is drawn once from that
snapshot with a fixed seed, so each configuration runs the same choices and greedy outputs can
be compared token for token. The chosen strategy's per-position acceptance goes with the
request, so the engine may draft less when the batch is large (cost.py).

Every figure that matters is a ratio between configurations measured in the same run; the
machine is noisy (load average recorded per configuration).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import dataclasses
import gc
import io
import json
import math
import os
import platform
import pstats
import random
import resource
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from bench import batch_report as rep
from bench.auto import arm_name
from bench.load import Service, _count, _epoch, fire, poll_until_finished
from bench.passes import pass_shapes
from bench.receipts import RECEIPT_SCHEMA, receipt_rows, receipts
from bench.strategies import load_dataset
from structspec.cli import add_model_args, settings_from
from structspec.config import Settings
from structspec.engine.engine import Engine, Request, refused
from structspec.engine.prompt import build_prompt
from structspec.options import RequestOptions
from structspec.services.strategy import selector_config
from structspec.stats.aggregate import InMemoryStats
from structspec.stats.selector import Selector

ROOT = Path(__file__).resolve().parents[1]
PARTS = "abcdef"
RUN_ORDER = "fdceab"  # f first: its peak RSS is then the model's plus its own, not another part's
MiB = 1024 * 1024


def say(msg: str) -> None:
    print(f"bench batch: {msg}", file=sys.stderr, flush=True)


# --- documents -----------------------------------------------------------------------------------

def shortest_rows(path: str, n: int) -> list[dict]:
    """The n shortest documents of a JSONL dataset ({schema, text} per line), shortest first."""
    rows = load_dataset(path, sys.maxsize)
    rows.sort(key=lambda r: len(r["text"]))
    return rows[:n]


# --- auto in process ---------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    """What one request runs: options and, for a proposing `auto` choice, its acceptance curve."""

    options: RequestOptions
    acceptance: list[float] | None = None

    @property
    def arm(self) -> str:
        return arm_name(self.options.strategy, self.options.draft_len)


class AutoPicker:
    """The service's selector over one stats key (one schema, or a dataset pooled as one user's
    family of schemas, as bench/auto.py pools DeepJSONEval)."""

    def __init__(self, settings: Settings, seed: int):
        self.selector = Selector(selector_config(settings))
        self.stats = InMemoryStats(settings.stats_half_life)
        self.seed = seed

    def plan(self, rng: random.Random, max_tokens: int) -> Plan:
        views = self.stats.views()
        c = self.selector.choose(views, rng)
        opts = RequestOptions(strategy=c.strategy, draft_len=c.draft_len, max_tokens=max_tokens)
        # a Thompson draw of the curve, as the worker passes it (structspec/services/strategy.py)
        acc = self.selector.draft_acceptance(views, c.strategy, c.draft_len, rng) if c.strategy != "none" else None
        return Plan(opts, acc)

    def warm_up(self, engine: Engine, rows: list[dict], max_tokens: int) -> list[str]:
        """Run `rows` one at a time, learning from each (the first ones probe every proposer)."""
        rng, arms = random.Random(self.seed + 1), []
        for row in rows:
            p = self.plan(rng, max_tokens)
            res = engine.extract(row["schema"], row["text"], p.options, acceptance=p.acceptance)
            self.stats.record(res.stats.as_dict())
            arms.append(p.arm)
        return arms

    def plans(self, n: int, max_tokens: int) -> list[Plan]:
        """n choices drawn from the current statistics (no learning between them)."""
        rng = random.Random(self.seed)
        return [self.plan(rng, max_tokens) for _ in range(n)]

    def run_live(self, engine: Engine, rows: list[dict], max_tokens: int) -> list:
        """`rows` one at a time as the service runs lone `auto` jobs: each drawn from the
        statistics as they stand, and recorded before the next is drawn. It learns on a copy,
        so every call starts from the same statistics (this picker's, e.g. after warm_up) and
        draws the same way; the results, in order."""
        stats, self.stats = self.stats, copy.deepcopy(self.stats)
        try:
            rng, results = random.Random(self.seed), []
            for row in rows:
                p = self.plan(rng, max_tokens)
                res = engine.extract(row["schema"], row["text"], p.options, acceptance=p.acceptance)
                self.stats.record(res.stats.as_dict())
                results.append(res)
            return results
        finally:
            self.stats = stats


def fixed_plans(strategy: str, n: int, max_tokens: int, draft_len: int = 8) -> list[Plan]:
    return [Plan(RequestOptions(strategy=strategy, draft_len=0 if strategy == "none" else draft_len,
                                max_tokens=max_tokens)) for _ in range(n)]


# --- one configuration ---------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    results: list
    wall_s: float
    metrics: dict
    max_running: int
    load: tuple[float, float]
    decode_only: dict  # steps that computed no prefill rows: {steps, s, tokens}


def run_requests(engine: Engine, rows: list[dict], plans: list[Plan], reuse_prompt: bool = False) -> Run:
    """Submit every row at once and step the engine until all are done (Engine.run, plus what
    it does not report: the most sequences that ran together, and the steps that computed no
    prefill rows with the tokens they emitted); wall_s covers submission (prompt, grammar) to
    the last result."""
    before = engine.metrics.as_dict()
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    requests = [Request(row["schema"], row["text"], p.options, acceptance=p.acceptance, reuse_prompt=reuse_prompt)
                for row, p in zip(rows, plans)]
    results, most = {}, 0
    for r in requests:
        try:
            engine.submit(r)
        except ValueError as e:
            results[r.id] = refused(r, e)
    pure = {"steps": 0, "s": 0.0, "tokens": 0}
    while engine.has_work():
        m0, out0 = engine.metrics, emitted_so_far(engine)
        prefill_rows, decode_steps = m0.prefill_rows, m0.decode_steps
        ts = time.perf_counter()
        done = engine.step()
        dt = time.perf_counter() - ts
        most = max(most, engine.running)
        if engine.metrics.prefill_rows == prefill_rows and engine.metrics.decode_steps > decode_steps:
            pure["steps"] += 1
            pure["s"] += dt
            pure["tokens"] += emitted_so_far(engine) + sum(len(r.tokens) for r in done) - out0
        for res in done:
            results[res.request_id] = res
    wall = time.perf_counter() - t0
    return Run([results[r.id] for r in requests], wall, rep.metrics_delta(before, engine.metrics.as_dict()),
               most, (load0, os.getloadavg()[0]), pure)


def emitted_so_far(engine: Engine) -> int:
    """Output tokens of the sequences the engine is running (read-only look at its scheduler)."""
    return sum(len(seq.out) for seq in engine.scheduler.running)


def summarize(name: str, run: Run, engine: Engine | None = None, **extra) -> dict:
    extra = {"max_running": run.max_running, "loadavg": [round(x, 2) for x in run.load], **extra}
    if engine is not None:
        extra.update(cost=rep.cost_points(engine.cost.snapshot(engine.scheduler.max_seqs)),
                     kv_peak_mib=engine.kv.peak_bytes / MiB,
                     prefix_hits=engine.kv.prefix.hits, prefix_misses=engine.kv.prefix.misses)
    return rep.summarize_run(name, [r.stats.as_dict() for r in run.results], [r.status for r in run.results],
                             run.wall_s, run.metrics, decode_only=run.decode_only, **extra)


def fresh(base: Engine, **overrides) -> Engine:
    """A new engine on the same loaded model (own KV cache, prefix cache and cost curve)."""
    gc.collect()
    return Engine(base.loaded, base.settings, **overrides)


# --- (a) batched auto against auto@1 and batched none, DeepJSONEval ---------------------------------

def part_a(base: Engine, args) -> dict:
    if not Path(args.dataset).is_file():
        say(f"(a) skipped: dataset {args.dataset} is absent")
        return {"skipped": f"dataset {args.dataset} is absent"}
    rows = shortest_rows(args.dataset, args.docs + args.warmup)
    docs, warm = rows[:args.docs], rows[args.docs:]
    if len(docs) < args.docs:
        return {"skipped": f"{args.dataset} has only {len(docs)} documents"}
    batch = base.settings.engine_max_seqs
    picker = AutoPicker(base.settings, args.seed)
    engine = fresh(base)
    say(f"(a) auto warm-up on {len(warm)} documents")
    warm_arms = picker.warm_up(engine, warm, args.max_tokens)
    del engine
    auto_plans = picker.plans(len(docs), args.max_tokens)
    configs = [("auto@1", auto_plans, {"engine_max_seqs": 1}),
               (f"auto@{batch}", auto_plans, {}),
               (f"none@{batch}", fixed_plans("none", len(docs), args.max_tokens), {})]
    runs, tokens = [], {}
    for rep_i in range(args.repeats):
        for name, plans, overrides in (configs if rep_i % 2 == 0 else configs[::-1]):
            say(f"(a) repeat {rep_i + 1}/{args.repeats}: {name} on {len(docs)} documents")
            engine = fresh(base, **overrides)
            run = run_requests(engine, docs, plans)
            runs.append(summarize(name, run, engine, repeat=rep_i))
            tokens.setdefault(name, [r.tokens for r in run.results])
            say(f"(a) {name}: {runs[-1]['wall_s']:.0f} s, e2e {runs[-1]['e2e_tok_s']:.1f} tok/s, "
                f"decode {runs[-1]['decode_tok_s']:.1f} tok/s")
            del engine
    pooled = [rep.pooled(runs, name) for name, _, _ in configs]
    one, auto_b, none_b = pooled
    ref = tokens["auto@1"]
    identical = {name: sum(a == b for a, b in zip(t, ref)) for name, t in tokens.items() if name != "auto@1"}
    verdicts = {
        "e2e_vs_auto1": rep.ratio(auto_b["e2e_tok_s"], one["e2e_tok_s"]),
        "decode_vs_auto1": rep.ratio(auto_b["decode_tok_s"], one["decode_tok_s"]),
        "e2e_vs_none": rep.ratio(auto_b["e2e_tok_s"], none_b["e2e_tok_s"]),
        "decode_vs_none": rep.ratio(auto_b["decode_tok_s"], none_b["decode_tok_s"]),
        # if batching made decode free and prefill stayed as at max_seqs=1: the most e2e could gain
        "amdahl_e2e_bound_vs_auto1": rep.ratio(one["wall_s"], one["prefill_step_s"]),
    }
    return {"documents": [r.get("id") for r in docs], "doc_chars": [len(r["text"]) for r in docs],
            "warmup_arms": warm_arms, "auto_arms": _count(p.arm for p in auto_plans),
            "max_tokens": args.max_tokens, "batch": batch, "runs": runs, "pooled": pooled,
            "identical_to_auto1": identical, "verdicts": verdicts}


# --- (b) documents/min through a real server + worker ---------------------------------------------

def part_b(args) -> dict:
    schema = json.loads(RECEIPT_SCHEMA.read_text())
    docs = [r["text"] for r in receipts(args.receipts, args.seed)]
    warm = [r["text"] for r in receipts(args.warmup, args.seed + 1000)]
    options = {"max_tokens": args.receipt_max_tokens}  # strategy: the server's default (auto)
    default = Settings().engine_max_seqs
    one = ("max_seqs=1, one batch", {"STRUCTSPEC_ENGINE_MAX_SEQS": "1"}, "batch")
    batched = (f"default (max_seqs={default}), one batch", {}, "batch")
    configs = [one, batched]
    if args.server_single_posts:
        configs.append((f"default (max_seqs={default}), {len(docs)} single-job POSTs", {}, "jobs"))
    runs = []
    for rep_i in range(args.server_repeats):
        for name, env, mode in (configs if rep_i % 2 == 0 else configs[::-1]):
            say(f"(b) repeat {rep_i + 1}/{args.server_repeats}: {name}, {len(docs)} receipts")
            with Service(threads=args.threads, env=env, timeout=args.server_timeout, connections=len(docs),
                         keep_logs=args.keep_logs, log_prefix=f"batch-b{rep_i}-{len(runs)}",
                         say=lambda m: say(f"(b) {m}")) as svc:
                r = svc.http.post("/v1/schemas", json={"name": "bench-receipt", "schema": schema})
                r.raise_for_status()
                schema_id = r.json()["id"]
                for text in warm:  # the worker loads the model; auto probes each proposer
                    svc.run_one(schema_id, text, options)
                load0, batch0 = os.getloadavg()[0], batch_sums(svc.http, schema_id)
                if mode == "batch":
                    record = run_batch(svc, schema_id, docs, options)
                else:
                    record = run_single_posts(svc, schema_id, docs, options)
                batch1 = batch_sums(svc.http, schema_id)
            mean_batch = rep.ratio(batch1[0] - batch0[0], batch1[1] - batch0[1]) if batch0 and batch1 else None
            record.pop("results", None)
            runs.append(server_summary(name, **record, repeat=rep_i, loadavg=[load0, os.getloadavg()[0]],
                                       mean_batch=mean_batch, submission=mode))
            say(f"(b) {name}: {runs[-1]['docs_per_min']} documents/min, mean batch {mean_batch}")
    pooled = [pool_server(runs, name) for name, _, _ in configs]
    return {"receipts": len(docs), "max_tokens": args.receipt_max_tokens, "warmup_jobs": len(warm),
            "runs": runs, "pooled": pooled,
            "ratio_default_vs_one": rep.ratio(pooled[1]["docs_per_min"], pooled[0]["docs_per_min"]),
            "ratio_single_posts_vs_one": (rep.ratio(pooled[2]["docs_per_min"], pooled[0]["docs_per_min"])
                                          if len(pooled) > 2 else None)}


def run_batch(svc: Service, schema_id: str, docs: list[str], options: dict) -> dict:
    """POST /v1/batches with every document (the API publishes job_chunk_size jobs per message)
    and wait for its last job; the run's record for server_summary, and its result lines."""
    t0 = time.time()
    r = svc.http.post("/v1/batches", json={"schema_id": schema_id, "options": options,
                                           "documents": [{"id": i, "document": d} for i, d in enumerate(docs)]})
    r.raise_for_status()
    batch_id = r.json()["id"]
    while True:  # the API's long poll answers as the batch ends; between answers, the children's health
        b = svc.http.get(f"/v1/batches/{batch_id}", params={"wait": 5}).json()
        if b.get("finished_at"):
            break
        svc.children.check()
        if time.monotonic() > svc.deadline:
            break
    lines = [json.loads(x) for x in svc.http.get(f"/v1/batches/{batch_id}/results").text.splitlines() if x.strip()]
    return {"batch_id": batch_id, "submitted": len(docs), "errors": len(docs) - b["total"], "first_submit": t0,
            "results": lines,
            "last_finish": _epoch(b["finished_at"]) if b.get("finished_at") else None,
            "statuses": {k: v for k, v in b["counts"].items() if v}, "stats": [x.get("stats") or {} for x in lines],
            "error_samples": [x.get("error") for x in lines if x.get("error")][:3]}


def run_single_posts(svc: Service, schema_id: str, docs: list[str], options: dict) -> dict:
    """One POST /v1/extractions per document, all at once (one job per message), as bench load does."""
    subs = fire(svc.http, schema_id, docs, options, len(docs))
    ids = [s["id"] for s in subs if s["ok"]]
    jobs = poll_until_finished(svc.http, ids, svc.deadline, svc.children.check, say=lambda m: say(f"(b) {m}"))
    finished = [j for j in jobs.values() if j.get("finished_at")]
    return {"submitted": len(subs), "errors": sum(not s["ok"] for s in subs), "first_submit": min(s["t0"] for s in subs),
            "last_finish": max((_epoch(j["finished_at"]) for j in finished), default=None),
            "statuses": _count(j["status"] for j in jobs.values()),
            "stats": [j.get("stats") or {} for j in finished],
            "error_samples": [j.get("error") for j in jobs.values() if j.get("error")][:3]}


def batch_sums(http, schema_id: str) -> tuple[float, float] | None:
    """(sum over the schema's jobs of each job's mean batch size, jobs) from the stats endpoint;
    None if it does not report mean_batch_size."""
    r = http.get(f"/v1/schemas/{schema_id}/stats")
    if r.status_code != 200:
        return None
    arms = r.json().get("strategies", [])
    if any("mean_batch_size" not in a for a in arms):
        return None
    return (sum(a["requests"] * (a["mean_batch_size"] or 0) for a in arms), sum(a["requests"] for a in arms))


def server_summary(name: str, *, submitted: int, errors: int, first_submit: float, last_finish: float | None,
                   statuses: dict[str, int], stats: list[dict], error_samples: list, **extra) -> dict:
    """Documents/min: finished jobs over first submission to the last job's finished_at."""
    finished = sum(n for st, n in statuses.items() if st in ("succeeded", "failed", "cancelled"))
    wall = (last_finish - first_submit) if last_finish is not None else None
    return {"config": name, "submitted": submitted, "errors": errors, "finished": finished, "statuses": statuses,
            "wall_s": wall, "docs_per_min": round(finished / wall * 60, 2) if wall else None,
            "output_tokens": sum(s.get("output_tokens") or 0 for s in stats),
            "strategies": _count(s.get("strategy") for s in stats), "error_samples": error_samples, **extra}


def pool_server(runs: list[dict], name: str) -> dict:
    mine = [r for r in runs if r["config"] == name]
    finished, wall = sum(r["finished"] for r in mine), sum(r["wall_s"] or 0 for r in mine)
    statuses: Counter = Counter()
    for r in mine:
        statuses.update(r["statuses"])
    weighted = [(r["mean_batch"], r["finished"]) for r in mine if r["mean_batch"] is not None]
    return {"config": name, "repeats": len(mine), "submitted": sum(r["submitted"] for r in mine),
            "errors": sum(r["errors"] for r in mine), "finished": finished, "statuses": dict(statuses),
            "wall_s": wall, "docs_per_min": round(finished / wall * 60, 2) if wall else None,
            "mean_batch": rep.ratio(sum(b * n for b, n in weighted), sum(n for _, n in weighted))}


# --- (c) + (e): one engine with every receipt prompt cached ---------------------------------------

class CachedReceipts:
    """An engine at the largest engine_max_seqs whose prefix cache holds every receipt's whole
    prompt; configurations lower scheduler.max_seqs (the bitmask is sized for the largest), so
    they all decode without prefill and share the engine's learnt pass-cost curve."""

    def __init__(self, base: Engine, args):
        self.rows = receipt_rows(args.receipts, args.seed)
        self.max_tokens = args.seqs_max_tokens
        self.top = max(args.seqs)
        tok, ctx = base.loaded.tokenizer, base.loaded.context_len
        lengths = [len(build_prompt(tok, r["schema"], r["text"], ctx)) for r in self.rows]
        bpt = base.kv.layout.bytes_per_token
        prefix_mb = math.ceil(sum(lengths) * bpt * 1.1 / MiB) + 16
        slots_mb = math.ceil(self.top * (max(lengths) + self.max_tokens) * bpt / MiB) + 16
        budget_mb = max(base.kv.budget_bytes // MiB, prefix_mb + slots_mb)
        self.engine = fresh(base, engine_max_seqs=self.top, engine_prefix_cache_mb=prefix_mb,
                            engine_kv_budget_mb=budget_mb)
        self.picker = AutoPicker(base.settings, args.seed)
        say(f"(c) auto warm-up on {args.warmup} receipts; caching {len(self.rows)} prompts "
            f"({sum(lengths)} tokens, {prefix_mb} MiB)")
        self.warm_arms = self.picker.warm_up(self.engine, receipt_rows(args.warmup, args.seed + 1000), self.max_tokens)
        run_requests(self.engine, self.rows, fixed_plans("none", len(self.rows), 1), reuse_prompt=True)
        self.auto_plans = self.picker.plans(len(self.rows), self.max_tokens)
        self.none_plans = fixed_plans("none", len(self.rows), self.max_tokens)

    def run(self, strategy: str, max_seqs: int, rows: list[dict] | None = None, max_tokens: int | None = None) -> Run:
        self.engine.scheduler.max_seqs = max_seqs
        rows = rows or self.rows
        plans = self.auto_plans if strategy == "auto" else self.none_plans
        plans = plans[:len(rows)]
        if max_tokens is not None:
            plans = [dataclasses.replace(p, options=p.options.replace(max_tokens=max_tokens)) for p in plans]
        run = run_requests(self.engine, rows, plans, reuse_prompt=True)
        computed = sum(r.stats.prefill_tokens for r in run.results)
        if computed:
            say(f"WARNING: {computed} prompt tokens were computed: the prefix cache did not hold every prompt")
        return run


def docs_for(max_seqs: int, available: int) -> int:
    """Receipts a configuration runs: two rounds of its batch, at least 8, at most all. A rate
    at batch 1 or 4 does not depend on how many documents queue behind, so the small batches
    run fewer documents (their decode is what takes the time)."""
    return min(available, max(8, 2 * max_seqs))


def part_c(cached: CachedReceipts, args) -> dict:
    runs = []
    for rep_i in range(args.seqs_repeats):
        order = list(args.seqs) if rep_i % 2 == 0 else list(args.seqs)[::-1]
        for i, m in enumerate(order):
            rows = cached.rows[:docs_for(m, len(cached.rows))]
            for strategy in (("none", "auto") if (i + rep_i) % 2 == 0 else ("auto", "none")):
                run = cached.run(strategy, m, rows=rows)
                runs.append(summarize(f"{strategy}@{m}", run, cached.engine, strategy=strategy, max_seqs=m,
                                      repeat=rep_i))
                say(f"(c) {strategy}@{m}: decode {runs[-1]['decode_tok_s']:.1f} tok/s, "
                    f"{runs[-1]['tokens_per_pass']:.2f} tokens/pass")
    pooled = []
    for m in args.seqs:
        for strategy in ("none", "auto"):
            p = rep.pooled(runs, f"{strategy}@{m}")
            p.update(strategy=strategy, max_seqs=m)
            pooled.append(p)
    by = {(p["strategy"], p["max_seqs"]): p for p in pooled}
    one = min(args.seqs)
    for p in pooled:
        p["vs_same_at_1"] = rep.ratio(p["decode_tok_s"], by[(p["strategy"], one)]["decode_tok_s"])
        p["vs_none_same_seqs"] = rep.ratio(p["decode_tok_s"], by[("none", p["max_seqs"])]["decode_tok_s"])
        p["vs_auto_at_1"] = rep.ratio(p["decode_tok_s"], by[("auto", one)]["decode_tok_s"])
    return {"receipts": len(cached.rows), "max_tokens": cached.max_tokens, "warmup_arms": cached.warm_arms,
            "auto_arms": _count(p.arm for p in cached.auto_plans), "runs": runs, "pooled": pooled,
            "cost_curve": {str(b): {str(r): v for r, v in rows.items()}
                           for b, rows in cached.engine.cost.snapshot().items()}}


def plot_c(part: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for strategy, marker in (("none", "o"), ("auto", "s")):
        pts = sorted((p["max_seqs"], p["decode_tok_s"], p["tokens_per_pass"]) for p in part["pooled"]
                     if p["strategy"] == strategy)
        ax1.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker=marker, label=strategy)
        ax2.plot([x for x, _, _ in pts], [t for _, _, t in pts], marker=marker, label=strategy)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks([p["max_seqs"] for p in part["pooled"]][::2], [str(p["max_seqs"]) for p in part["pooled"]][::2])
        ax.set_xlabel("engine_max_seqs")
        ax.legend()
    ax1.set_ylabel("decode output tokens/s (prompts cached)")
    ax2.set_ylabel("output tokens per sequence per pass")
    fig.suptitle(f"{part['receipts']} synthetic receipts, max_tokens {part['max_tokens']}, CPU, 1 torch thread")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "batch_throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def part_e(cached: CachedReceipts, part_c_result: dict | None, args) -> dict:
    m = 16 if 16 in args.seqs else max(args.seqs)
    name = f"none@{m}"
    measured = [r for r in (part_c_result or {}).get("runs", []) if r["config"] == name]
    if not measured:
        run = cached.run("none", m)
        measured = [summarize(name, run, cached.engine)]
    totals = rep.metrics_delta({}, measured[0]["metrics"])
    for r in measured[1:]:
        totals = {k: totals[k] + r["metrics"][k] for k in totals}
    wall = sum(r["wall_s"] for r in measured)
    ov = rep.overhead(totals)
    # a short run under cProfile: the top engine-side costs
    rows = cached.rows[:m]
    prof = cProfile.Profile()
    prof.enable()
    run = cached.run("none", m, rows=rows, max_tokens=args.profile_tokens)
    prof.disable()
    shapes = pass_shapes(cached.engine, args.shape_contexts)
    return {"config": name, "steps": totals["steps"], "decode_steps": totals["decode_steps"], "pass_shapes": shapes,
            "step_s": totals["step_s"], "forward_s": totals["forward_s"], "verify_s": totals["verify_s"],
            "wall_s": wall, "outside_forward_share": ov["decode_only"], "verify_share": ov["verify_share"],
            "wall_outside_forward_share": rep.ratio(wall - totals["forward_s"], wall),
            "profile": profile_summary(prof, run.wall_s), "profile_docs": len(rows),
            "profile_max_tokens": args.profile_tokens}


# cumulative time of these functions says where a step's time goes (the forward includes the model)
PROFILED = {
    "runner.forward (model)": ("runner.py", "forward"),
    "engine.step": ("engine.py", "step"),
    "engine._plan": ("engine.py", "_plan"),
    "engine._propose_and_mask": ("engine.py", "_propose_and_mask"),
    "step.propose": ("step.py", "propose"),
    "step.fill_bitmask": ("step.py", "fill_bitmask"),
    "step.pack": ("step.py", "pack"),
    "step.verify": ("step.py", "verify"),
    "step.commit": ("step.py", "commit"),
    "engine._account": ("engine.py", "_account"),
    "engine._finish": ("engine.py", "_finish"),
    "engine.submit": ("engine.py", "submit"),
    "scheduler.admit": ("scheduler.py", "admit"),
    "ragged_attention": ("kv_cache.py", "ragged_attention"),
}


def profile_summary(prof: cProfile.Profile, wall_s: float, top: int = 15) -> dict:
    st = pstats.Stats(prof)
    by_name = {}
    for (filename, _, func), (_, ncalls, tottime, cumtime, _) in st.stats.items():
        for label, (file_end, fn) in PROFILED.items():
            if func == fn and filename.endswith(file_end) and "structspec" in filename:
                by_name[label] = {"calls": ncalls, "cum_s": round(cumtime, 4)}
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    tottime = [{"function": f"{Path(f).name}:{line}({func})", "calls": v[1], "tottime_s": round(v[2], 4),
                "cumtime_s": round(v[3], 4)} for (f, line, func), v in rows]
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return {"wall_s": wall_s, "by_function": by_name, "top_tottime": tottime, "text": text.getvalue()}


# --- (d) prefix cache on / off --------------------------------------------------------------------

def part_d(base: Engine, args) -> dict:
    rows = receipt_rows(args.receipts, args.seed)
    configs = [("prefix cache on", {}), ("prefix cache off", {"engine_prefix_cache_mb": 0})]
    runs = []
    order = [c for i in range(args.prefix_repeats) for c in (configs if i % 2 == 0 else configs[::-1])]
    for rep_i, (name, overrides) in enumerate(order):  # on, off, then off, on, ...
        engine = fresh(base, **overrides)
        run = run_requests(engine, rows, fixed_plans("none", len(rows), 1))
        runs.append(summarize(name, run, engine, repeat=rep_i, prefix_reused_tokens=engine.kv.prefix.reused_tokens))
        say(f"(d) {name}: prefill steps {runs[-1]['prefill_step_s']:.1f} s, {runs[-1]['prefill_tokens']} tokens computed, "
            f"{runs[-1]['prefix_tokens']} reused")
        del engine
    pooled = [rep.pooled(runs, name) for name, _ in configs]
    on, off = pooled
    return {"receipts": len(rows), "runs": runs, "pooled": pooled,
            "prefill_s_saved": off["prefill_step_s"] - on["prefill_step_s"],
            "prefill_s_ratio_off_vs_on": rep.ratio(off["prefill_step_s"], on["prefill_step_s"]),
            "steps_on_off": [on_steps(runs, "prefix cache on"), on_steps(runs, "prefix cache off")],
            "wall_ratio_off_vs_on": rep.ratio(off["wall_s"], on["wall_s"]),
            "tokens_ratio_off_vs_on": rep.ratio(off["prefill_tokens"], on["prefill_tokens"])}


def on_steps(runs: list[dict], name: str) -> int:
    """Engine steps of a configuration's runs (prefill is chunked: fewer prompt rows a step, more steps)."""
    return sum(r["metrics"]["steps"] for r in runs if r["config"] == name)


# --- (f) a KV budget for a few sequences ---------------------------------------------------------

def part_f(base: Engine, args) -> dict:
    rows = receipt_rows(args.low_kv_docs, args.seed)
    tok, ctx = base.loaded.tokenizer, base.loaded.context_len
    lengths = [len(build_prompt(tok, r["schema"], r["text"], ctx)) for r in rows]
    bpt = base.kv.layout.bytes_per_token
    per_seq = (max(lengths) + args.low_kv_tokens) * bpt
    budget_mb = math.ceil(args.low_kv_fit * per_seq / MiB)
    rss_before = _maxrss_mib()
    engine = fresh(base, engine_kv_budget_mb=budget_mb)
    say(f"(f) {len(rows)} receipts under a {budget_mb} MiB KV budget ({per_seq / MiB:.1f} MiB per sequence at most)")
    run = run_requests(engine, rows, fixed_plans("composite", len(rows), args.low_kv_tokens))
    out = summarize("low KV budget", run, engine)
    complete = sum(r.status in ("succeeded", "truncated") for r in run.results)
    out.update(budget_mib=budget_mb, budget_bytes=engine.kv.budget_bytes, peak_kv_bytes=engine.kv.peak_bytes,
               peak_within_budget=engine.kv.peak_bytes <= engine.kv.budget_bytes, per_seq_mib=per_seq / MiB,
               complete=complete, all_complete=complete == len(rows), peak_rss_before_mib=rss_before,
               peak_rss_mib=_maxrss_mib(), strategy="composite:8", max_tokens=args.low_kv_tokens)
    del engine
    return out


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# --- report ----------------------------------------------------------------------------------------

def conditions(base: Engine, args) -> dict:
    s = base.settings
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit, "model": base.loaded.name,
            "device": str(base.loaded.device), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "engine": {**{k: getattr(s, k) for k in ("engine_max_seqs", "engine_prefill_chunk",
                                                     "engine_prefix_cache_mb")},
                       "engine_kv_budget_mb": base.kv.budget_bytes // MiB},
            "runner": "batched" if base.batched else "sequential",
            "kv_bytes_per_token": base.kv.layout.bytes_per_token, "argv": sys.argv[1:]}


def markdown(result: dict) -> str:
    c = result["conditions"]
    parts = result["parts"]
    out = [f"conditions: {c['date']}, commit {c['commit']}, model {c['model']} on {c['device']}, torch "
           f"{c['torch']} with {c['torch_threads']} thread(s), {c['cpus']} CPUs, load average "
           f"{c['loadavg_start'][0]} at start, {c.get('loadavg_end', ['?'])[0]} at end; wall {result.get('wall_s', 0):.0f} s"]
    if "a" in parts:
        out += ["", "### (a) DeepJSONEval, batched auto against auto@1 and batched none", ""]
        out += [md_a(parts["a"])]
    if "b" in parts:
        out += ["", "### (b) real server + worker, synthetic receipts", "", md_b(parts["b"])]
    if "c" in parts:
        out += ["", "### (c) decode throughput against engine_max_seqs (prompts cached)", "", md_c(parts["c"])]
    if "d" in parts:
        out += ["", "### (d) prefix cache on / off", "", md_d(parts["d"])]
    if "e" in parts:
        out += ["", "### (e) engine overhead", "", md_e(parts["e"])]
    if "f" in parts:
        out += ["", "### (f) low KV budget", "", md_f(parts["f"])]
    return "\n".join(out) + "\n"


def md_a(a: dict) -> str:
    if "skipped" in a:
        return f"skipped: {a['skipped']}"
    b = a["batch"]
    lines = [rep.throughput_table(a["pooled"], {"auto@1": "auto@1", f"none@{b}": f"none@{b}"}), ""]
    v = a["verdicts"]
    lines.append(f"- batched auto >= 3x auto@1: end to end **{rep.verdict(v['e2e_vs_auto1'], 3.0)}** "
                 f"({rep.fmt_ratio(v['e2e_vs_auto1'])}), decode **{rep.verdict(v['decode_vs_auto1'], 3.0)}** "
                 f"({rep.fmt_ratio(v['decode_vs_auto1'])}); prefill alone caps end to end at "
                 f"{rep.fmt_ratio(v['amdahl_e2e_bound_vs_auto1'])} (auto@1's wall over its prefill seconds)")
    lines.append(f"- batched auto >= batched none: end to end **{rep.verdict(v['e2e_vs_none'], 1.0)}** "
                 f"({rep.fmt_ratio(v['e2e_vs_none'])}), decode **{rep.verdict(v['decode_vs_none'], 1.0)}** "
                 f"({rep.fmt_ratio(v['decode_vs_none'])})")
    lines.append("- outputs identical to auto@1: " + ", ".join(f"{k} {n}/{len(a['documents'])}"
                                                               for k, n in a["identical_to_auto1"].items()))
    lines.append(f"- auto's choices: {a['auto_arms']} (warm-up: {a['warmup_arms']})")
    for r in a["runs"]:
        if r["config"] == f"auto@{b}" and r["cost"]:
            pts = ", ".join(f"{p['rows']} rows {p['s_per_pass'] * 1000:.0f} ms ({p['s_per_row'] * 1000:.1f} ms/row)"
                            for p in r["cost"])
            lines.append(f"- pass cost learnt by batched auto's engine: {pts}")
            break
    return "\n".join(lines)


def md_b(b: dict) -> str:
    head = ["config", "submitted", "errors", "finished", "statuses", "first submit to last finish s", "documents/min",
            "mean batch (schema stats)"]
    rows = [[p["config"], p["submitted"], p["errors"], p["finished"], rep.statuses(p["statuses"]),
             rep.fmt(p["wall_s"], ".1f"), rep.fmt(p["docs_per_min"], ".1f"), rep.fmt(p["mean_batch"], ".1f")]
            for p in b["pooled"]]
    text = rep.table(head, rows) + f"\n\ndefault against max_seqs=1: {rep.fmt_ratio(b['ratio_default_vs_one'])}"
    if b.get("ratio_single_posts_vs_one") is not None:
        text += f"; single-job POSTs against max_seqs=1: {rep.fmt_ratio(b['ratio_single_posts_vs_one'])}"
    return text


def md_c(c: dict) -> str:
    head = ["strategy", "max_seqs", "docs", "output tokens", "tokens/pass", "mean batch", "decode s", "decode tok/s",
            "vs same strategy @1", "vs none, same max_seqs", "vs auto@1", "outside forward"]
    rows = []
    for p in c["pooled"]:
        ov = [r["overhead"]["decode_only"] for r in c["runs"] if r["config"] == p["config"]]
        rows.append([p["strategy"], p["max_seqs"], p["documents"], p["output_tokens"], rep.fmt(p["tokens_per_pass"]),
                     rep.fmt(p["mean_batch"], ".1f"), rep.fmt(p["decode_s"], ".1f"), rep.fmt(p["decode_tok_s"], ".1f"),
                     rep.fmt_ratio(p["vs_same_at_1"]), rep.fmt_ratio(p["vs_none_same_seqs"]),
                     rep.fmt_ratio(p["vs_auto_at_1"]), rep.fmt(ov[0] if ov else None, ".1%")])
    return rep.table(head, rows) + f"\n\nauto's choices: {c['auto_arms']}"


def md_d(d: dict) -> str:
    head = ["config", "runs", "prompt tokens", "computed", "reused from cache", "prefill-step s", "wall s"]
    rows = [[p["config"], p["repeats"], p["prompt_tokens"], p["prefill_tokens"], p["prefix_tokens"],
             rep.fmt(p["prefill_step_s"], ".1f"), rep.fmt(p["wall_s"], ".1f")] for p in d["pooled"]]
    return (rep.table(head, rows) + f"\n\nprefill seconds saved: {d['prefill_s_saved']:.1f} "
            f"(steps on/off {d['steps_on_off'][0]}/{d['steps_on_off'][1]}; "
            f"off/on {rep.fmt_ratio(d['prefill_s_ratio_off_vs_on'])} seconds, "
            f"{rep.fmt_ratio(d['tokens_ratio_off_vs_on'])} tokens computed, wall {rep.fmt_ratio(d['wall_ratio_off_vs_on'])})")


def md_e(e: dict) -> str:
    lines = [f"{e['config']}: {e['decode_steps']} decode-only steps, step {e['step_s']:.1f} s, forward "
             f"{e['forward_s']:.1f} s: **{rep.fmt(e['outside_forward_share'], '.1%')} of step time outside the "
             f"forward** (target <= 15%: {rep.verdict(e['outside_forward_share'], 0.15, higher_is_better=False)}; "
             f"verification {rep.fmt(e['verify_share'], '.1%')}); whole loop incl. submit/admit/finish: "
             f"{rep.fmt(e['wall_outside_forward_share'], '.1%')} outside the forward", "",
             f"cProfile ({e['profile_docs']} cached receipts, max_tokens {e['profile_max_tokens']}, "
             f"{e['profile']['wall_s']:.1f} s), cumulative seconds:", ""]
    by = e["profile"]["by_function"]
    lines.append(rep.table(["function", "calls", "cumulative s"],
                           [[k, v["calls"], f"{v['cum_s']:.3f}"] for k, v in sorted(by.items(), key=lambda kv: -kv[1]["cum_s"])]))
    if e.get("pass_shapes"):
        lines += ["", "one forward pass by shape (median ms; every sequence at the given context):", "",
                  rep.table(["context", "sequences x rows each", "rows", "ms"],
                            [[p["context"], f"{p['sequences']} x {p['rows_each']}", p["rows"], p["ms"]]
                             for p in e["pass_shapes"]])]
    lines += ["", "top self time:", "",
              rep.table(["function", "calls", "self s", "cumulative s"],
                        [[t["function"], t["calls"], f"{t['tottime_s']:.3f}", f"{t['cumtime_s']:.3f}"]
                         for t in e["profile"]["top_tottime"][:10]])]
    return "\n".join(lines)


def md_f(f: dict) -> str:
    return rep.table(
        ["documents", "KV budget MiB", "per sequence MiB (worst)", "most running at once", "statuses", "all complete",
         "peak KV MiB", "peak KV <= budget", "peak RSS MiB (before -> after)", "wall s"],
        [[f["documents"], f["budget_mib"], f"{f['per_seq_mib']:.1f}", f["max_running"], rep.statuses(f["statuses"]),
          "yes" if f["all_complete"] else "**no**", f"{f['peak_kv_bytes'] / MiB:.1f}",
          "yes" if f["peak_within_budget"] else "**no**", f"{f['peak_rss_before_mib']:.0f} -> {f['peak_rss_mib']:.0f}",
          f"{f['wall_s']:.1f}"]])


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "batch.md").write_text(markdown(result))


def run_batch_bench(args, settings: Settings) -> int:
    parts = [p for p in RUN_ORDER if p in args.parts]
    if not parts or set(args.parts) - set(PARTS):
        print(f"structspec: error: --parts takes letters of {PARTS} (got {args.parts!r})", file=sys.stderr)
        return 2
    try:
        args.seqs = tuple(sorted({int(x) for x in str(args.seqs).split(",") if x.strip()}))
    except ValueError:
        args.seqs = ()
    try:
        args.shape_contexts = tuple(int(x) for x in str(args.shape_contexts).split(",") if x.strip())
    except ValueError:
        args.shape_contexts = ()
    if not args.seqs or min(args.seqs) < 1:
        print(f"structspec: error: --seqs takes positive integers (got {args.seqs!r})", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = Path(args.out)
    settings.apply_torch_threads()
    say(f"loading model {settings.model!r}")
    base = Engine.from_settings(settings)
    result = {"conditions": conditions(base, args), "parts": {}}
    cached = None
    for p in parts:
        tp = time.perf_counter()
        if p == "a":
            result["parts"]["a"] = part_a(base, args)
        elif p == "b":
            result["parts"]["b"] = part_b(args)
        elif p in "ce":
            cached = cached or CachedReceipts(base, args)
            if p == "c":
                result["parts"]["c"] = part_c(cached, args)
                result["parts"]["c"]["plot"] = str(plot_c(result["parts"]["c"], out))
            else:
                result["parts"]["e"] = part_e(cached, result["parts"].get("c"), args)
        elif p == "d":
            result["parts"]["d"] = part_d(base, args)
        elif p == "f":
            result["parts"]["f"] = part_f(base, args)
        result["parts"][p]["part_wall_s"] = time.perf_counter() - tp
        say(f"part ({p}) took {result['parts'][p]['part_wall_s']:.0f} s")
        if p == "e" or (p == "c" and "e" not in parts):
            cached = None
        result["wall_s"] = time.perf_counter() - t0
        result["conditions"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        write(out, result)
    text = markdown(result)
    print(text)
    say(f"wrote {out / 'batch.json'} and {out / 'batch.md'} in {result['wall_s'] / 60:.1f} min")
    f = result["parts"].get("f")
    return 1 if f and not (f["all_complete"] and f["peak_within_budget"]) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.batch",
                                description="The batched engine against one sequence at a time: parts a-f (this "
                                            "module's docstring); Markdown on stdout, batch.json, batch.md and "
                                            "batch_throughput.png in --out.")
    p.add_argument("--parts", default="abcdef", help="which parts to run (default %(default)s)")
    p.add_argument("--dataset", default="../shared/data/deepjsoneval_en.jsonl", help="JSONL for part a (skipped if absent)")
    p.add_argument("--docs", type=int, default=32, help="a: the shortest documents measured")
    p.add_argument("--warmup", type=int, default=4, help="documents auto learns from first (a, b, c)")
    p.add_argument("--max-tokens", type=int, default=192, help="a: per document")
    p.add_argument("--repeats", type=int, default=1, help="a: runs of each configuration (order alternates)")
    p.add_argument("--receipts", type=int, default=32, help="b, c, d: synthetic receipts")
    p.add_argument("--receipt-max-tokens", type=int, default=64, help="b: max_tokens per receipt")
    p.add_argument("--seqs", default="1,4,16,32", help="c: engine_max_seqs values")
    p.add_argument("--seqs-max-tokens", type=int, default=48, help="c, e: max_tokens per receipt")
    p.add_argument("--seqs-repeats", type=int, default=1, help="c: runs of each configuration")
    p.add_argument("--profile-tokens", type=int, default=16, help="e: max_tokens of the profiled run")
    p.add_argument("--prefix-repeats", type=int, default=1, help="d: runs of cache on and off (order alternates)")
    p.add_argument("--shape-contexts", default="400,1300",
                   help="e: context lengths at which one forward pass is timed by shape (sequences x rows)")
    p.add_argument("--low-kv-docs", type=int, default=64, help="f: receipts")
    p.add_argument("--low-kv-fit", type=int, default=4, help="f: sequences the KV budget holds at most")
    p.add_argument("--low-kv-tokens", type=int, default=32, help="f: max_tokens per receipt")
    p.add_argument("--server-repeats", type=int, default=1, help="b: runs of each worker configuration")
    p.add_argument("--server-timeout", type=float, default=1800, help="b: give up on a service after this many s")
    p.add_argument("--server-single-posts", action="store_true",
                   help="b: also the default worker with one POST /v1/extractions per document")
    p.add_argument("--keep-logs", metavar="DIR", help="b: copy the server and worker logs here")
    p.add_argument("--seed", type=int, default=0, help="receipts and auto's draws")
    p.add_argument("--out", default="bench-out", help="directory for batch.json, batch.md, batch_throughput.png")
    add_model_args(p)
    args = p.parse_args(argv)
    return run_batch_bench(args, settings_from(args))


if __name__ == "__main__":
    sys.exit(main())
