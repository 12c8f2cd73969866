"""`python -m bench.load`: many concurrent submissions against a real server and worker.

Starts `structspec serve` and one `structspec worker` as subprocesses (as `structspec demo`
does: SQLite + the embedded broker in a temporary directory unless --database-url and
--broker-url name others), registers a small schema, runs one warm-up job (the worker loads
the model), then fires --jobs POST /v1/extractions at once from --concurrency threads, each
a short document, and records every request's latency. It then polls until every job is
finished (bounded by --timeout) and reports errors (non-2xx or transport failures), jobs by
final status, submission latency percentiles and completion throughput: a Markdown table on
stdout and the whole record as JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from bench import percentile
from structspec.demo import Children, free_port, healthy, raise_interrupt, wait_for

ROOT = Path(__file__).resolve().parents[1]  # the checkout the children import structspec from

SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "item": {"type": "string", "maxLength": 40},
        "quantity": {"type": "integer", "minimum": 0},
        "total": {"type": "number"},
    },
    "required": ["customer", "item", "quantity", "total"],
}
NAMES = ["Ana Lima", "Bo Chen", "Cy Okafor", "Dee Novak", "Eli Haddad", "Fay Moreau", "Gus Tanaka", "Hal Berg"]
ITEMS = ["desk lamp", "coffee beans", "usb cable", "notebook", "water bottle", "phone case", "tea kettle"]
FINISHED = ("succeeded", "failed", "cancelled")


def documents(n: int, seed: int = 0) -> list[str]:
    """n short order notes (about 100 characters each), reproducible for a seed."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        qty, price = rng.randint(1, 9), rng.randint(200, 9900) / 100
        out.append(f"Order {1000 + i}: {rng.choice(NAMES)} bought {qty} x {rng.choice(ITEMS)} "
                   f"at ${price:.2f} each, total ${qty * price:.2f}.")
    return out


def summarize(submissions: list[dict], jobs: dict[str, dict], first_submit: float, last_submit: float,
              last_finish: float | None) -> dict:
    """The report: `submissions` are {ok, status_code, latency_s, error?} per request (times in
    seconds since the epoch for the three instants); `jobs` maps accepted job ids to their last
    read state ({status, created_at, finished_at, ...})."""
    latencies = [s["latency_s"] for s in submissions]
    errors = [s for s in submissions if not s["ok"]]
    by_status: dict[str, int] = {}
    for job in jobs.values():
        by_status[job["status"]] = by_status.get(job["status"], 0) + 1
    finished = sum(n for s, n in by_status.items() if s in FINISHED)
    wall = (last_finish - first_submit) if last_finish is not None and finished else None
    turnaround = [j["turnaround_s"] for j in jobs.values() if j.get("turnaround_s") is not None]
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {
        "submitted": len(submissions),
        "accepted": len(jobs),
        "errors": len(errors),
        "error_samples": [{k: e.get(k) for k in ("status_code", "error")} for e in errors[:10]],
        "succeeded": by_status.get("succeeded", 0),
        "failed": by_status.get("failed", 0),
        "other": len(jobs) - by_status.get("succeeded", 0) - by_status.get("failed", 0),
        "by_status": by_status,
        "all_finished": finished == len(jobs) == len(submissions),
        "submit_ms": {"p50": ms(percentile(latencies, 50)), "p95": ms(percentile(latencies, 95)),
                      "p99": ms(percentile(latencies, 99)), "max": ms(max(latencies, default=None))},
        "submit_window_s": round(last_submit - first_submit, 3) if submissions else None,
        "submissions_per_s": (round(len(submissions) / (last_submit - first_submit), 1)
                              if len(submissions) > 1 and last_submit > first_submit else None),
        "turnaround_s": {"p50": _round(percentile(turnaround, 50)), "p99": _round(percentile(turnaround, 99))},
        "wall_s": _round(wall),
        "jobs_per_s": round(finished / wall, 3) if wall else None,
    }


def _round(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def markdown(summary: dict, label: str) -> str:
    s, sm = summary, summary["submit_ms"]
    rows = [
        ("stack", label),
        ("submissions (concurrent)", f"{s['submitted']} ({s['concurrency']})"),
        ("errors (non-2xx or transport)", s["errors"]),
        ("jobs succeeded / failed / other", f"{s['succeeded']} / {s['failed']} / {s['other']}"),
        ("every job finished", "yes" if s["all_finished"] else "**no**"),
        ("submission latency p50 / p95 / p99 / max (ms)", f"{sm['p50']} / {sm['p95']} / {sm['p99']} / {sm['max']}"),
        ("all submissions sent in (s)", f"{s['submit_window_s']} ({s['submissions_per_s']}/s)"),
        ("job turnaround p50 / p99 (s, created to finished)",
         f"{s['turnaround_s']['p50']} / {s['turnaround_s']['p99']}"),
        ("first submission to last completion (s)", s["wall_s"]),
        ("completion throughput (jobs/s)", s["jobs_per_s"]),
    ]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def _epoch(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def fire(http, schema_id: str, docs: list[str], options: dict, concurrency: int) -> list[dict]:
    """POST every document at once (threads released together); one record per request."""
    start = threading.Barrier(min(concurrency, len(docs)))

    def one(doc: str) -> dict:
        try:
            start.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass
        t0 = time.time()
        try:
            r = http.post("/v1/extractions", json={"schema_id": schema_id, "document": doc, "options": options})
            rec = {"ok": r.status_code in (200, 202), "status_code": r.status_code}
            if rec["ok"]:
                rec["id"] = r.json()["id"]
            else:
                rec["error"] = r.text[:300]
        except Exception as e:  # transport errors count as errors
            rec = {"ok": False, "status_code": None, "error": f"{type(e).__name__}: {e}"[:300]}
        rec.update(t0=t0, latency_s=time.time() - t0)
        return rec

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, docs))


def poll_until_finished(http, ids: list[str], deadline: float, check, interval: float = 2.0,
                        say=None, per_round: int = 10) -> dict[str, dict]:
    """Read jobs until all are finished or the deadline passes; returns the last state read of
    each. Jobs run roughly in submission order, so each round reads the oldest unfinished ones
    first and at most `per_round` (or all, if they are finished) to keep the API and the
    worker's CPU mostly free."""
    state: dict[str, dict] = {}
    pending = list(ids)
    last = None
    while pending:
        still = []
        reads = 0
        for job_id in pending:
            if reads >= per_round and still:  # the rest wait for the next round: keep the API mostly free
                still.append(job_id)
                continue
            j = http.get(f"/v1/extractions/{job_id}").json()
            reads += 1
            state[job_id] = j
            if j["status"] not in FINISHED:
                still.append(job_id)
        pending = still
        if say and len(pending) != last:
            say(f"{len(ids) - len(pending)}/{len(ids)} finished")
            last = len(pending)
        if pending:
            check()
            if time.monotonic() > deadline:
                break
            time.sleep(interval)
    for j in state.values():
        if j.get("finished_at") and j.get("created_at"):
            j["turnaround_s"] = _epoch(j["finished_at"]) - _epoch(j["created_at"])
    return state


class Service:
    """`structspec serve` and one `structspec worker` as subprocesses on loopback, with an API
    key of a tenant of its own: `with Service(...) as svc:` gives `svc.http`, an httpx client
    that sends the key. SQLite + the embedded broker in a temporary directory unless URLs are
    given; `env` adds worker/server settings (e.g. STRUCTSPEC_ENGINE_MAX_SEQS)."""

    def __init__(self, *, database_url: str | None = None, broker_url: str | None = None, threads: int | None = None,
                 rate_limit: int = 0, worker_concurrency: int | None = None, env: dict[str, str] | None = None,
                 timeout: float = 1800, request_timeout: float = 120, connections: int = 100,
                 keep_logs: str | None = None, log_prefix: str = "load", say=None):
        self.say = say or (lambda msg: print(f"bench load: {msg}", file=sys.stderr, flush=True))
        self.data_dir = Path(tempfile.mkdtemp(prefix="structspec-load-"))
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.label = stack_label(database_url, broker_url)
        self.deadline = time.monotonic() + timeout
        self.worker_concurrency, self.request_timeout, self.connections = worker_concurrency, request_timeout, connections
        self.keep_logs, self.log_prefix = keep_logs, log_prefix
        self.env = service_env(self.data_dir, database_url, broker_url, threads, rate_limit, env or {})
        self.children = Children(self.env, self.data_dir)
        self.http = None

    def __enter__(self) -> "Service":
        import httpx

        self._previous = signal.signal(signal.SIGTERM, raise_interrupt)
        try:
            self.say(f"{self.label}; data in {self.data_dir}; API on {self.base}")
            # Every request goes through auth with a key of its own tenant, as in production.
            created = subprocess.run([sys.executable, "-m", "structspec.cli", "keys", "create", "--name", "bench-load",
                                      "--tenant", f"load-{uuid.uuid4().hex[:8]}"], cwd=ROOT, env=self.env,
                                     capture_output=True, text=True, timeout=300)
            if created.returncode != 0:
                raise RuntimeError(f"structspec keys create failed: {created.stderr.strip()[-2000:]}")
            auth = {"authorization": f"Bearer {created.stdout.split()[-1]}"}
            self.children.start("server", "serve", "--port", str(self.port))
            wait_for(lambda: healthy(httpx, self.base), self.children, self.deadline, "the API to become healthy")
            self.children.start("worker", "worker", *(["--concurrency", str(self.worker_concurrency)]
                                                      if self.worker_concurrency else []))
            limits = httpx.Limits(max_connections=self.connections, max_keepalive_connections=self.connections)
            self.http = httpx.Client(base_url=self.base, timeout=self.request_timeout, limits=limits, headers=auth)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def run_one(self, schema_id: str, document: str, options: dict) -> dict:
        """Submit one job and wait for it, as a client doing one document at a time would (the
        API's ?wait, then polling should it run longer); its last state."""
        r = self.http.post("/v1/extractions?wait=60", json={"schema_id": schema_id, "document": document,
                                                            "options": options})
        r.raise_for_status()
        job = r.json()
        if r.status_code == 200:
            return job
        return poll_until_finished(self.http, [job["id"]], self.deadline, self.children.check, interval=0.5)[job["id"]]

    def job_spans(self, batch_id: str) -> list[tuple[float, float]]:
        """(started, finished) as epoch seconds of each finished job of a batch, as the worker
        stamped them in the service's database (the API reports when a job ended, not when it began)."""
        import sqlalchemy as sa

        from structspec.config import Settings
        from structspec.db.models import JobRecord
        from structspec.db.session import make_engine

        engine = make_engine(Settings.from_env(self.env).database_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(sa.select(JobRecord.started_at, JobRecord.finished_at).where(
                    JobRecord.batch_id == uuid.UUID(batch_id), JobRecord.started_at.is_not(None),
                    JobRecord.finished_at.is_not(None)))
                return [(started.timestamp(), finished.timestamp()) for started, finished in rows]
        finally:
            engine.dispose()

    def __exit__(self, *exc) -> None:
        self.say("stopping the worker and the API")
        if self.http is not None:
            self.http.close()
        self.children.stop_all()
        signal.signal(signal.SIGTERM, self._previous)
        if self.keep_logs:
            for name in ("server", "worker"):
                src = self.data_dir / f"{name}.log"
                if src.exists():
                    Path(self.keep_logs).mkdir(parents=True, exist_ok=True)
                    shutil.copy(src, Path(self.keep_logs) / f"{self.log_prefix}-{name}.log")
        shutil.rmtree(self.data_dir, ignore_errors=True)


def service_env(data_dir: Path, database_url: str | None, broker_url: str | None, threads: int | None,
                rate_limit: int, extra: dict[str, str]) -> dict[str, str]:
    """The children's environment: this one's, less every STRUCTSPEC_ setting but the model's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRUCTSPEC_") or k in (
        "STRUCTSPEC_MODEL", "STRUCTSPEC_DEVICE", "STRUCTSPEC_CACHE_DIR", "STRUCTSPEC_KERNEL_BACKEND",
        "STRUCTSPEC_GRAMMAR_BACKEND", "STRUCTSPEC_LOG_FORMAT")}
    env.update(STRUCTSPEC_DATA_DIR=str(data_dir), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               # a queue of our own: a shared Redis may carry other workers' queues
               STRUCTSPEC_JOB_QUEUE=f"structspec-load-{uuid.uuid4().hex[:8]}",  # its ingest queue follows it
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if database_url:
        env["STRUCTSPEC_DATABASE_URL"] = database_url
    if broker_url:
        env["STRUCTSPEC_BROKER_URL"] = broker_url
    if threads is not None:
        env["STRUCTSPEC_TORCH_THREADS"] = str(threads)
    # One client firing many requests at once is what the per-client rate limit refuses (429
    # past its burst); the limiter has its own tests, the benchmarks measure the service behind it.
    env["STRUCTSPEC_RATE_LIMIT_PER_MINUTE"] = str(rate_limit)
    env.update(extra)
    return env


def run_load_bench(args) -> int:
    say = lambda msg: print(f"bench load: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    options = {"max_tokens": args.max_tokens, **({"strategy": args.strategy} if args.strategy else {})}
    try:
        with Service(database_url=args.database_url, broker_url=args.broker_url, threads=args.threads,
                     rate_limit=args.rate_limit, worker_concurrency=args.worker_concurrency, timeout=args.timeout,
                     request_timeout=args.request_timeout, connections=args.concurrency, keep_logs=args.keep_logs,
                     say=say) as svc:
            http, label = svc.http, svc.label
            r = http.post("/v1/schemas", json={"name": "load-order", "schema": SCHEMA})
            r.raise_for_status()
            schema_id = r.json()["id"]
            say("warm-up job (the worker loads the model)")
            svc.run_one(schema_id, documents(1, 99)[0], options)
            docs = documents(args.jobs, args.seed)
            say(f"firing {len(docs)} submissions from {args.concurrency} threads")
            subs = fire(http, schema_id, docs, options, args.concurrency)
            first_submit = min(s["t0"] for s in subs)
            last_submit = max(s["t0"] + s["latency_s"] for s in subs)
            ids = [s["id"] for s in subs if s["ok"]]
            say(f"{len(ids)} accepted, {len(subs) - len(ids)} errors; waiting for the jobs")
            jobs = poll_until_finished(http, ids, svc.deadline, svc.children.check, say=say)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finishes = [_epoch(j["finished_at"]) for j in jobs.values() if j.get("finished_at")]
    summary = summarize(subs, jobs, first_submit, last_submit, max(finishes, default=None))
    summary.update(stack=label, concurrency=args.concurrency, jobs_requested=args.jobs,
                   max_tokens=args.max_tokens, strategy=args.strategy or "server default",
                   worker_concurrency=args.worker_concurrency, rate_limit_per_minute=args.rate_limit,
                   auth="Bearer key",
                   strategies_used=_count(j.get("stats", {}) and j["stats"].get("strategy") for j in jobs.values()),
                   failure_samples=[j.get("error") for j in jobs.values() if j["status"] == "failed"][:5])
    print(markdown(summary, label), flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"summary": summary, "submissions": subs,
                                   "jobs": {k: {f: v.get(f) for f in ("status", "created_at", "finished_at",
                                                                      "error", "timings", "stats")}
                                            for k, v in jobs.items()}}, indent=1, default=str))
        say(f"wrote {out}")
    ok = summary["errors"] == 0 and summary["all_finished"]
    say("PASS: zero errors, every job finished" if ok else "FAIL: errors or unfinished jobs")
    return 0 if ok else 1


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        if v:
            out[v] = out.get(v, 0) + 1
    return out


def stack_label(database_url: str | None, broker_url: str | None) -> str:
    db = (database_url or "sqlite").split(":", 1)[0].split("+")[0]
    broker = (broker_url or "sqla+sqlite").split(":", 1)[0]
    return f"database {db}, broker {'embedded (sqla+sqlite)' if broker == 'sqla+sqlite' else broker}"


def main(argv: list[str] | None = None) -> int:
    from structspec.options import JOB_STRATEGIES

    p = argparse.ArgumentParser(prog="python -m bench.load",
                                description="Many concurrent POST /v1/extractions against a real server and worker. "
                                            "Start `structspec serve` and a real `structspec worker` (default model; "
                                            "SQLite + embedded broker in a temporary directory unless "
                                            "--database-url/--broker-url), fire --jobs small extraction jobs at "
                                            "once, wait until all are finished and report errors, final statuses, "
                                            "submission latency percentiles and completion throughput (Markdown on "
                                            "stdout, JSON in --out). Exit 1 on any error or unfinished job.")
    p.add_argument("--jobs", type=int, default=200, help="submissions (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=0, help="client threads (default: one per job)")
    p.add_argument("--max-tokens", type=int, default=64, help="per job (default %(default)s)")
    p.add_argument("--strategy", choices=JOB_STRATEGIES, help="job strategy (default: the server's, auto)")
    p.add_argument("--timeout", type=float, default=1800, help="give up after this many seconds in all")
    p.add_argument("--request-timeout", type=float, default=120, help="per HTTP request, seconds")
    p.add_argument("--database-url", help="e.g. postgresql://postgres@127.0.0.1/structspec_load "
                                          "(default: SQLite in a temporary directory)")
    p.add_argument("--broker-url", help="e.g. redis://127.0.0.1:6379/0 (default: the embedded broker)")
    p.add_argument("--worker-concurrency", type=int, default=0,
                   help="the worker's --concurrency (task threads; default: the worker's own)")
    p.add_argument("--threads", type=int, help="torch threads in the worker [env STRUCTSPEC_TORCH_THREADS]")
    p.add_argument("--seed", type=int, default=0, help="seeds the generated documents")
    p.add_argument("--out", default="bench-out/load.json", help="JSON record (default %(default)s)")
    p.add_argument("--keep-logs", metavar="DIR", help="copy the server and worker logs here")
    p.add_argument("--rate-limit", type=int, default=0, metavar="N",
                   help="the server's rate_limit_per_minute (default 0 = off: one client firing --jobs at once "
                        "is what the limiter refuses)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    args.concurrency = args.concurrency or args.jobs
    return run_load_bench(args)


if __name__ == "__main__":
    sys.exit(main())
