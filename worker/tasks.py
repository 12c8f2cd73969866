"""Job tasks: take job ids, claim them in the database, run the engine, store results.

The engine is loaded once per worker process, before it consumes anything, and stepped by a
thread of its own (structspec/engine/loop.py). Task threads (Celery's threads pool) claim their
message's jobs and hand them to that loop, so the jobs of several messages decode together in
one batch; each task stores its jobs' outcomes as they finish and is acked after the last
(acks_late). Tasks get ids, never ORM objects, and are idempotent: a job that is finished,
cancelled or held by a live lease is skipped, so redelivered or duplicated messages are
harmless. A worker killed mid-step loses no job: its leases run out and the reaper re-queues
them, and its unacked messages come back.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid
from concurrent.futures import Future, as_completed
from dataclasses import dataclass
from typing import Any, Callable

from celery import Task
from celery.signals import worker_ready, worker_shutdown

from structspec.config import Settings
from structspec.db.columns import utcnow
from structspec.db.jobs import JobRepository
from structspec.db.stats import StatsRepository
from structspec.db.repositories import SchemaRepository
from structspec.db.session import make_engine, make_session_factory
from structspec.grammar.verbatim import uses_verbatim
from structspec.logs import preview
from structspec.options import AUTO, OptionError, RequestOptions
from structspec.stats.resolve import InFlight, acceptance_curve, resolve_options
from worker.app import RUN_JOBS, app, enqueue

log = logging.getLogger("structspec.worker")

LOGGED_STATS = ("strategy", "draft_len", "output_tokens", "target_passes", "acceptance_rate", "prefill_s",
                "decode_s", "stop_reason")


class _Process:
    """What one worker process holds: the engine (stepped by its own thread, fed by every task
    thread) and a database session factory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop = None
        self._sessions = None

    def loop(self, settings: Settings):
        with self._lock:
            if self._loop is None:
                from structspec.engine.engine import Engine
                from structspec.engine.loop import EngineLoop

                settings.apply_torch_threads()
                log.info("loading model %r", settings.model)
                engine = Engine.from_settings(settings)
                log.info("engine ready: %s, up to %d sequences per step, KV budget %d MiB",
                         "batched" if engine.batched else "one sequence per forward pass (model cannot batch)",
                         engine.scheduler.max_seqs, settings.engine_kv_budget_mb)
                self._loop = EngineLoop(engine)
            return self._loop

    def sessions(self, settings: Settings):
        with self._lock:
            if self._sessions is None:
                self._sessions = make_session_factory(make_engine(settings.database_url))
            return self._sessions


PROCESS = _Process()
IN_FLIGHT = InFlight()  # this process's auto jobs chosen but not recorded yet (probes spread over a batch)


def prepare_model(settings: Settings) -> None:
    """Before the worker consumes anything: load the model and start the engine loop in this
    process. Raises ModelLoadError naming the model, so a worker that cannot run jobs never
    takes one."""
    PROCESS.loop(settings)


class JobTask(Task):
    """Base task: settings from the app, engine and sessions from this process."""

    @property
    def settings(self) -> Settings:
        return self.app.structspec_settings


@app.task(name=RUN_JOBS, base=JobTask, bind=True, acks_late=True, reject_on_worker_lost=True,
          ignore_result=True)
def run_jobs(self: JobTask, job_ids: list[str]) -> dict[str, int]:
    """Run a chunk of jobs. They join the process's engine loop beside the jobs of the other
    task threads, so several messages decode in one batch. Returns counts (for logs)."""
    settings = self.settings
    sessions = PROCESS.sessions(settings)
    ids = [uuid.UUID(i) for i in job_ids]
    token = uuid.uuid4().hex
    with sessions.begin() as session:
        claimed = JobRepository(session).claim(ids, token, settings.job_lease_s)
    log.info("claimed %d of %d job(s)", len(claimed), len(ids),
             extra={"job_ids": [str(i) for i in claimed], "skipped_ids": [str(i) for i in ids if i not in claimed]})
    if not claimed:
        return {"claimed": 0, "stored": 0}
    loop = PROCESS.loop(settings)
    stored = 0
    with LeaseKeeper(sessions, token, settings.job_lease_s) as keeper:
        running: dict[Future, Started] = {}
        for job_id in claimed:
            started = start_job(sessions, settings, job_id, token)
            if isinstance(started, Started):
                future = loop.submit(started.request)
                keeper.watch(job_id, lambda rid=started.request.id: loop.cancel(rid))
                running[future] = started
            else:
                stored += started
        for future in as_completed(running):
            stored += finish_job(sessions, settings, running[future], future, token)
    return {"claimed": len(claimed), "stored": stored}


@dataclass
class Started:
    """A held job handed to the engine: what storing its outcome needs."""

    job_id: uuid.UUID
    schema_id: uuid.UUID
    created_at: Any
    fields: dict[str, str]
    request: Any  # structspec.engine.sequence.Request (torch is imported with the engine, not here)
    started: float
    in_flight: tuple[uuid.UUID, bool, str] | None  # the IN_FLIGHT entry of an auto job


def start_job(sessions, settings: Settings, job_id: uuid.UUID, token: str) -> Started | int:
    """Mark a held job started and build its engine request; an int (jobs stored: 0 or 1) when
    it ends here (cancelled after the claim, or options this version cannot read)."""
    with sessions.begin() as session:
        repo = JobRepository(session)
        job = repo.held(job_id, token)
        if job is None:  # cancelled after the claim
            log.info("job skipped: cancelled after the claim", extra={"job_id": str(job_id)})
            return 0
        repo.mark_started(job_id, token)
        schema = SchemaRepository(session).get(job.schema_id, include_deleted=True).body
        document, schema_id, created_at = job.document, job.schema_id, job.created_at
        fields = {"job_id": str(job_id), "schema_id": str(schema_id)}
        if job.batch_id is not None:
            fields["batch_id"] = str(job.batch_id)
        attempt, queued_s = job.attempts, job.queued_s
        try:
            opts = RequestOptions.from_dict(job.options)
        except OptionError as e:  # a row this version cannot read: fail it, naming the option, not strand it
            ok = repo.store(job_id, token, status="failed", error=f"stored options cannot be used: {e}")
            log.warning("job failed", extra={**fields, "status": "failed", "error": preview(e)})
            return int(ok)
        auto = opts.strategy == AUTO
        verbatim = uses_verbatim(schema, opts.verbatim)
        try:
            with session.begin_nested():  # a failed read must not poison this transaction
                opts = resolve_options(session, settings, schema_id, job_id, opts, verbatim=verbatim,
                                       pending=IN_FLIGHT.pending(schema_id, verbatim))
                acceptance = None
                if auto and opts.strategy != "none" and opts.draft_len:
                    acceptance = acceptance_curve(session, settings, schema_id, opts.strategy, opts.draft_len,
                                                  verbatim=verbatim, job_id=job_id)
        except Exception:  # never strand a job on the selector: fall back to the fixed default
            log.exception("strategy selection failed; using %s", settings.strategy, extra=fields)
            opts = opts.replace(strategy=settings.strategy,
                                draft_len=settings.draft_len if opts.draft_len is None else opts.draft_len)
            acceptance = None
    log.info("job started", extra={**fields, "strategy": opts.strategy, "draft_len": opts.draft_len,
                                   "attempt": attempt, "queued_s": queued_s, "document_chars": len(document)})
    from structspec.engine.sequence import Request

    request = Request(schema, document, opts, id=str(job_id), acceptance=acceptance)
    in_flight = (schema_id, verbatim, opts.strategy) if auto else None
    if in_flight:
        IN_FLIGHT.begin(*in_flight)
    return Started(job_id, schema_id, created_at, fields, request, time.monotonic(), in_flight)


def finish_job(sessions, settings: Settings, job: Started, future: Future, token: str) -> int:
    """Store a job's outcome and its stats together; 1 if stored, 0 if cancelled/taken over."""
    outcome = outcome_of(future, job.fields)
    duration_s = round(time.monotonic() - job.started, 4)
    try:
        with sessions.begin() as session:
            ok = JobRepository(session).store(job.job_id, token, **outcome)
            if ok and outcome.get("stats"):  # same transaction: a stored result and its stats commit together
                StatsRepository(session).record(job.schema_id, outcome["stats"], half_life=settings.stats_half_life,
                                                latency_s=(utcnow() - job.created_at).total_seconds())
    finally:
        if job.in_flight:  # recorded (or never to be): no longer pending
            IN_FLIGHT.end(*job.in_flight)
    log_outcome(job.fields, outcome, duration_s, ok)
    return int(ok)


def log_outcome(fields: dict[str, str], outcome: dict[str, Any], duration_s: float, stored: bool) -> None:
    """One line per finished job: status, timings and counts; an error only as a short preview
    (it may quote the model's output, which may quote the document)."""
    stats = outcome.get("stats") or {}
    info = {**fields, "status": outcome["status"], "duration_s": duration_s,
            **{k: stats[k] for k in LOGGED_STATS if k in stats}}
    if not stored:
        log.info("job finished but not stored (cancelled or lease lost)", extra=info)
    elif outcome["status"] == "succeeded":
        log.info("job finished", extra=info)
    else:
        log.warning("job failed", extra={**info, "error": preview(outcome.get("error"))})


def outcome_of(future: Future, fields: dict[str, str]) -> dict[str, Any]:
    """The engine's answer as columns for JobRepository.store; never raises."""
    from structspec.engine.prompt import DocumentTooLong
    from structspec.grammar import SchemaError

    try:
        res = future.result()
    except (SchemaError, DocumentTooLong, ValueError) as e:  # refused at submission (options, size, schema)
        return {"status": "failed", "error": str(e)}
    except Exception as e:  # a bug or resource problem: fail the job visibly, keep the worker
        # The message may quote the document: a preview of it, and the stack without it.
        log.error("extraction crashed: %s: %s", type(e).__name__, preview(e),
                  extra={**fields, "stack": "".join(traceback.format_tb(e.__traceback__))[-1900:]})
        return {"status": "failed", "error": f"internal error: {type(e).__name__}: {e}"[:2000]}
    if res.status == "error":  # the engine logged it; the error names the exception
        return {"status": "failed", "error": res.error}
    stats = res.stats.as_dict()
    if res.status == "succeeded":
        return {"status": "succeeded", "result": res.value, "stats": stats}
    return {"status": "failed", "error": f"{res.status}: {res.error}", "stats": stats}


class LeaseKeeper:
    """Renews the leases held by `token` every lease/3 seconds while the block runs, so a long
    job is never mistaken for one whose worker died; a watched job that is no longer held
    (cancelled through the API, or taken over) gets its callback, which stops it in the engine."""

    def __init__(self, sessions, token: str, lease_s: float):
        self.sessions, self.token, self.lease_s = sessions, token, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._watched: dict[uuid.UUID, Callable[[], None]] = {}
        self._lock = threading.Lock()

    def watch(self, job_id: uuid.UUID, on_lost: Callable[[], None]) -> None:
        with self._lock:
            self._watched[job_id] = on_lost

    def __enter__(self) -> "LeaseKeeper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(max(self.lease_s / 3, 0.5)):
            try:
                with self.sessions.begin() as session:
                    repo = JobRepository(session)
                    repo.renew(self.token, self.lease_s)
                    held = repo.held_ids(self.token)
            except Exception:
                log.exception("lease renewal failed")
                continue
            with self._lock:
                lost = [(j, cb) for j, cb in self._watched.items() if j not in held]
                for j, _ in lost:
                    del self._watched[j]
            for _, on_lost in lost:  # finished jobs are not held either: stopping those is a no-op
                on_lost()


# --- reaper: re-queue jobs whose worker died --------------------------------------------------

def reap(settings: Settings, sessions) -> int:
    """Re-queue and re-publish jobs still `running` past their lease; returns how many. Send
    happens before commit, so a failed publish leaves them as they were for the next round."""
    token = "reaper-" + uuid.uuid4().hex[:16]
    with sessions.begin() as session:
        repo = JobRepository(session)
        ids, refs = repo.requeue_expired(token), {}
        if ids:
            enqueue(app, ids)
            refs = repo.refs(ids)
    for job_id in ids:
        schema_id, batch_id = refs.get(job_id, (None, None))
        log.warning("job re-queued: its lease expired (worker lost)",
                    extra={"job_id": str(job_id), "schema_id": str(schema_id),
                           **({"batch_id": str(batch_id)} if batch_id else {})})
    if ids:
        log.warning("re-queued %d job(s) whose lease expired", len(ids), extra={"count": len(ids)})
    return len(ids)


class Reaper:
    """Runs `reap` at worker start and then every lease/2 seconds (at least 1 s)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        sessions = make_session_factory(make_engine(self.settings.database_url))
        interval = max(self.settings.job_lease_s / 2, 1.0)
        while True:
            try:
                reap(self.settings, sessions)
            except Exception as e:
                log.warning("reaper round failed: %s", e)
            if self._stop.wait(interval):
                return


_REAPER: Reaper | None = None


@worker_ready.connect
def _on_ready(sender=None, **_) -> None:
    global _REAPER
    settings = app.structspec_settings
    _REAPER = Reaper(settings)
    _REAPER.start()
    PROCESS.loop(settings)  # loaded already by `structspec worker`; `celery worker` loads it here


@worker_shutdown.connect
def _on_shutdown(**_) -> None:
    if _REAPER is not None:
        _REAPER.stop()
