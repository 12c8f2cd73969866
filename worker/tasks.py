"""Job tasks: take job ids, claim them in the database, run the engine, store results.

The engine is loaded once per worker process, before it consumes anything, and stepped by a
thread of its own (structspec/engine/loop.py). Task threads (Celery's threads pool) claim their
message's jobs and hand them to that loop, so the jobs of several messages decode together in
one batch; each task stores its jobs' outcomes as they finish and is acked after the last
(acks_late). Tasks get ids, never ORM objects, and are idempotent: a job that is finished,
cancelled or held by a live lease is skipped, so redelivered or duplicated messages are
harmless. Claim, start and store retry through transient database errors (db/retry.py).

Time limits: the engine ends a job at its options' timeout_s (a step boundary), and a task waits
for each job at most that long plus STRUCTSPEC_ENGINE_WATCHDOG_S before failing it itself
(finish_jobs). The engine watchdog (worker/watchdog.py) ends a process whose engine loop holds
work and makes no progress: its leases are no longer renewed, and it exits for its supervisor.

The reaper (every worker runs one) is what guarantees that every job ends:
  - a job whose lease ran out (its worker died) is re-queued and published again, or failed
    once it has had STRUCTSPEC_JOB_MAX_ATTEMPTS attempts;
  - a job still `queued` long after its message was published, while the broker's queue is
    empty, lost its message and is published again.
It also POSTs the webhooks of finished batches (worker/webhooks.py) and deletes what finished
longer ago than STRUCTSPEC_JOB_RETENTION_DAYS (worker/retention.py).
It runs in each worker rather than in Celery beat: no extra process to deploy (or to lose),
and the conditional UPDATEs let any number of reapers run at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Callable

from celery import Task
from celery.signals import worker_process_init, worker_ready, worker_shutdown

from structspec.config import Settings
from structspec.db.columns import utcnow
from structspec.db.jobs import JobRepository
from structspec.db.retry import is_transient, retrying
from structspec.db.stats import StatsRepository
from structspec.db.repositories import SchemaRepository
from structspec.db.session import make_engine, make_session_factory
from structspec.grammar.verbatim import uses_verbatim
from structspec.logs import preview
from structspec.options import AUTO, OptionError, RequestOptions, timeout_error
from structspec.services.strategy import InFlight, acceptance_curve, concrete_options
from structspec.worker.app import RUN_JOBS, app, enqueue, enqueue_reads, queue_depth, report_engine_busy
from structspec.worker.progress import PROGRESS, Pieces
from structspec.worker.retention import PURGE_EVERY_S, purge_expired
from structspec.worker.watchdog import EXIT_ENGINE_HUNG, Watchdog
from structspec.worker.webhooks import deliver_webhooks

log = logging.getLogger("structspec.worker")

LOGGED_STATS = ("strategy", "draft_len", "output_tokens", "target_passes", "acceptance_rate", "prefill_s",
                "decode_s", "stop_reason")


class _Process:
    """What one worker process holds: the engine (stepped by its own thread, fed by every task
    thread) and a database session factory.

    With the prefork pool (`forking`) the parent builds the engine with one torch thread (no
    thread pool exists yet, so forking is safe) and each child starts its own loop over its
    copy of it after the fork (`after_fork`); the weights are shared copy-on-write."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine = None
        self._loop = None
        self._submissions = None
        self._sessions = None
        self.forking = False
        self.reads_only = False  # a worker of the ingest queue alone: no engine (worker/ingest.py)
        self.torch_threads = 0  # prefork: threads each child uses (0: torch's default)

    def engine(self, settings: Settings):
        with self._lock:
            return self._engine_locked(settings)

    def _engine_locked(self, settings: Settings):
        if self._engine is None:
            self._engine = self._build(settings)
        return self._engine

    def _build(self, settings: Settings):
        from structspec.engine.engine import Engine

        if not self.forking:
            settings.apply_torch_threads()
        log.info("loading model %r", settings.model)
        engine = Engine.from_settings(settings)
        log.info("engine ready: %s, up to %d sequences per step, KV budget %d MiB, dtype %s, "
                 "%s forward (%s layer steps, %s layer loop, %s verification), %d linear layers prepacked (%s)",
                 f"batched ({engine.runner.attention} attention)" if engine.batched
                 else "one sequence per forward pass (model cannot batch)",
                 engine.scheduler.max_seqs, engine.kv.budget_bytes // (1 << 20),
                 engine.loaded.dtype_note, engine.forward_name, engine.layer_steps, engine.layer_loop,
                 engine.verification,
                 engine.packed_linears, engine.linear)
        return engine

    def loop(self, settings: Settings):
        """The engine loop; without an engine yet (the threads pool) the loop's thread builds it,
        so that one thread does all of the process's torch work (engine/loop.py says why)."""
        with self._lock:
            if self._loop is None:
                from structspec.engine.loop import EngineLoop

                if self._engine is not None:  # a prefork child: its parent built it
                    self._loop = EngineLoop(self._engine)
                else:
                    self._loop = EngineLoop(lambda: self._build(settings))
                    self._engine = self._loop.engine
                loop = self._loop
                report_engine_busy(lambda: loop.busy)  # the embedded broker polls less while it runs
                Watchdog(loop, settings.engine_watchdog_s, lambda reason: engine_hung(settings, reason)).start()
            return self._loop

    def submissions(self, settings: Settings):
        """The engine loop, with chunking (services/chunks.py: ChunkedSubmissions)."""
        loop = self.loop(settings)
        with self._lock:
            if self._submissions is None:  # reset with the loop after a fork (after_fork)
                from structspec.services.chunks import ChunkedSubmissions

                self._submissions = ChunkedSubmissions(loop)
            return self._submissions

    def sessions(self, settings: Settings):
        with self._lock:
            if self._sessions is None:
                self._sessions = make_session_factory(make_engine(settings.database_url))
            return self._sessions

    def after_fork(self, settings: Settings) -> None:
        """In a prefork child: nothing of the parent's threads or connections is used."""
        self._lock = threading.Lock()
        self._loop = self._submissions = self._sessions = None
        HISTORIES_SEEDED.clear()  # this child's engine is its own copy: built from the database again
        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)
        self.loop(settings)


PROCESS = _Process()
IN_FLIGHT = InFlight()  # this process's auto jobs chosen but not recorded yet (probes spread over a batch)
SEED_OUTPUTS = 256  # a schema's latest succeeded outputs the suffix proposer starts from in a new process


class _FirstSeen:
    """Keys seen by this process (thread-safe): the suffix memory of a schema is built from the
    database once per process, by its first job (worker/tasks.py: start_job)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def first(self, key: str) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()


HISTORIES_SEEDED = _FirstSeen()


def prepare_model(settings: Settings, processes: int = 0) -> None:
    """Before the worker consumes anything: load the model, and (threads pool, `processes` 0)
    start the engine loop in this process. Raises ModelLoadError naming the model, so a worker
    that cannot run jobs never takes one. With a prefork pool of `processes` children: build
    the engine with one torch thread and leave a loop to each child, with
    `settings.torch_threads` threads or an equal share of the cores."""
    if not processes:
        PROCESS.loop(settings)
        return
    import torch

    PROCESS.forking = True
    PROCESS.torch_threads = settings.torch_threads or max(1, (os.cpu_count() or 1) // processes)
    torch.set_num_threads(1)
    PROCESS.engine(settings)


class JobTask(Task):
    """Base task: settings from the app, engine and sessions from this process."""

    @property
    def settings(self) -> Settings:
        return self.app.structspec_settings


class Isolation:
    """A job on a later attempt (its lease ran out before: most often its worker died) runs
    alone in this process: while it runs, no task thread claims anything, and the engine
    admits it only once the sequences ahead of it have finished (Request.isolate). If it is
    the document that crashes the process, the crash costs an attempt to it and to no other
    job, so STRUCTSPEC_JOB_MAX_ATTEMPTS fails the culprit and never its neighbours."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False

    @contextmanager
    def claiming(self):
        """Claims (and the start of what they claimed) one at a time, never while a retried
        job runs."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            yield self

    def hold(self) -> None:
        self._busy = True  # inside `claiming`

    def release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


ISOLATION = Isolation()


@app.task(name=RUN_JOBS, base=JobTask, bind=True, acks_late=True, reject_on_worker_lost=True,
          ignore_result=True)
def run_jobs(self: JobTask, job_ids: list[str]) -> dict[str, int]:
    """Run a chunk of jobs. First attempts join the process's engine loop beside the jobs of
    the other task threads, so several messages decode in one batch; later attempts run
    alone, one at a time (Isolation). Returns counts (for logs)."""
    settings = self.settings
    sessions = PROCESS.sessions(settings)
    ids = [uuid.UUID(i) for i in job_ids]
    token = uuid.uuid4().hex

    def claim() -> tuple[list[uuid.UUID], list[uuid.UUID]]:
        with sessions.begin() as session:
            repo = JobRepository(session)
            claimed = repo.claim(ids, token, settings.job_lease_s)
            return claimed, repo.retried(claimed)

    retried: list[uuid.UUID] = []
    keeper = None
    try:
        with ISOLATION.claiming():
            try:
                claimed, retried = retrying(claim, what=f"claiming {len(ids)} job(s)", budget_s=settings.job_lease_s)
            except Exception as e:  # the message is acked; the jobs stay queued and the reaper publishes them again
                log.error("could not claim %d job(s), they stay queued (the reaper publishes them again): %s",
                          len(ids), preview(e), extra={"job_ids": job_ids})
                return {"claimed": 0, "stored": 0}
            log.info("claimed %d of %d job(s)", len(claimed), len(ids),
                     extra={"job_ids": [str(i) for i in claimed],
                            "skipped_ids": [str(i) for i in ids if i not in claimed]})
            if not claimed:
                return {"claimed": 0, "stored": 0}
            if retried:
                ISOLATION.hold()
            keeper = LeaseKeeper(sessions, token, settings.job_lease_s).start()
            running, stored = submit_jobs(sessions, settings, [j for j in claimed if j not in retried], token, keeper)
        stored += finish_jobs(sessions, settings, running, token)
        for job_id in retried:  # alone, one after the other
            more, done = submit_jobs(sessions, settings, [job_id], token, keeper)
            stored += done + finish_jobs(sessions, settings, more, token)
    finally:
        if keeper is not None:
            keeper.stop()
        if retried:
            ISOLATION.release()
    return {"claimed": len(claimed), "stored": stored}


def submit_jobs(sessions, settings: Settings, job_ids: list[uuid.UUID], token: str,
                keeper: "LeaseKeeper") -> tuple[dict[Future, "Started"], int]:
    """Start held jobs and hand them to the engine loop: ({future: job}, jobs that ended at
    the start and were stored). A job whose start cannot reach the database is left to its
    lease (the reaper re-queues it)."""
    loop = PROCESS.submissions(settings)  # chunks a too-long document where its options ask (services/chunks.py)
    running: dict[Future, Started] = {}
    stored = 0
    for job_id in job_ids:
        try:
            started = retrying(lambda: start_job(sessions, settings, job_id, token),
                               what=f"starting job {job_id}", budget_s=settings.job_lease_s)
        except Exception as e:
            log.error("could not start the job; it runs again once its lease runs out: %s", preview(e),
                      extra={"job_id": str(job_id)})
            continue
        if isinstance(started, Started):
            future = loop.submit(started.request)
            started.stop = lambda rid=started.request.id: loop.cancel(rid)
            keeper.watch(job_id, started.stop)
            started.answer_by = (time.monotonic() + started.request.options.with_defaults(settings).timeout_s
                                 + settings.engine_watchdog_s)
            running[future] = started
        else:
            stored += started
    return running, stored


def finish_jobs(sessions, settings: Settings, running: dict[Future, "Started"], token: str) -> int:
    """Store each job's outcome as it finishes; returns how many were stored. Each wait is
    bounded (Started.answer_by): a job the engine has not answered by then is stopped there and
    failed with its time limit's error (the engine ends a job at its limit, and a hung engine's
    watchdog acts sooner, so only a request the engine lost gets here)."""
    stored, pending = 0, dict(running)
    while pending:
        now = time.monotonic()
        for future in [f for f, job in pending.items() if job.answer_by <= now and not f.done()]:
            job = pending.pop(future)
            job.stop()
            stored += finish_job(sessions, settings, job, overdue(job, settings), token)
        if pending:
            first = min(job.answer_by for job in pending.values())
            done, _ = wait(pending, timeout=max(first - now, 0.0), return_when=FIRST_COMPLETED)
            for future in done:
                stored += finish_job(sessions, settings, pending.pop(future), future, token)
    return stored


class Overdue(Exception):
    """A job the engine did not answer within its time limit plus STRUCTSPEC_ENGINE_WATCHDOG_S."""


def overdue(job: "Started", settings: Settings) -> Future:
    """The failed answer finish_jobs stores for a job the engine never answered."""
    limit = job.request.options.with_defaults(settings).timeout_s
    answer: Future = Future()
    answer.set_exception(Overdue(f"timeout: {timeout_error(limit)}; the engine had not stopped it "
                                 f"{settings.engine_watchdog_s} s later (STRUCTSPEC_ENGINE_WATCHDOG_S)"))
    return answer


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
    pieces: Pieces | None = None  # a chat job's output text (worker/progress.py)
    # once handed to the engine (submit_jobs): when finish_jobs stops waiting for its answer
    # (time.monotonic), and what stops it in the engine
    answer_by: float = float("inf")
    stop: Callable[[], None] = lambda: None


def start_job(sessions, settings: Settings, job_id: uuid.UUID, token: str) -> Started | int:
    """Mark a held job started and build its engine request; an int (jobs stored: 0 or 1) when
    it ends here (cancelled or deleted after the claim, or options this version cannot read)."""
    with sessions.begin() as session:
        repo = JobRepository(session)
        job = repo.held(job_id, token)
        if job is None:  # cancelled or deleted after the claim
            log.info("job skipped: cancelled or deleted after the claim", extra={"job_id": str(job_id)})
            return 0
        repo.mark_started(job_id, token)
        schema = SchemaRepository(session).get(job.schema_id, include_deleted=True).body
        document, messages, schema_id, created_at = job.document, job.messages, job.schema_id, job.created_at
        history = f"{job.tenant}/{schema_id}"  # the suffix proposer's memory: this tenant's, this schema version's
        history_seed = None
        if settings.engine_suffix_mb > 0 and HISTORIES_SEEDED.first(history):
            history_seed = repo.recent_outputs(job.tenant, schema_id, SEED_OUTPUTS)
        stream = job.stream
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
                opts = concrete_options(session, settings, schema_id, job_id, opts, verbatim=verbatim,
                                        pending=IN_FLIGHT.pending(schema_id, verbatim))
                acceptance = None
                if auto and opts.strategy != "none" and opts.draft_len:
                    acceptance = acceptance_curve(session, settings, schema_id, opts.strategy, opts.draft_len,
                                                  verbatim=verbatim, job_id=job_id)
        except Exception as e:  # never strand a job on the selector: fall back to the fixed default
            if is_transient(e):  # the database, not the selector: retry the whole start (run_jobs)
                raise
            log.exception("strategy selection failed; using %s", settings.strategy, extra=fields)
            opts = opts.replace(strategy=settings.strategy,
                                draft_len=settings.draft_len if opts.draft_len is None else opts.draft_len)
            acceptance = None
    log.info("job started", extra={**fields, "strategy": opts.strategy, "draft_len": opts.draft_len,
                                   "attempt": attempt, "queued_s": queued_s, "document_chars": len(document)})
    from structspec.engine.sequence import Request

    # A later attempt follows a lost lease, most often a worker that died: decode it alone, so
    # a document that crashes the process takes no neighbour with it (and uses up none of
    # their attempts).
    # a chat job keeps its output text as generated (worker/progress.py): the reply's content
    pieces = Pieces() if messages is not None else None
    request = Request(schema, document, opts, id=str(job_id), acceptance=acceptance, isolate=attempt > 1,
                      messages=messages, on_output=pieces, history=history, history_seed=history_seed)
    if pieces is not None and stream:
        PROGRESS.watch(sessions, job_id, token, pieces)
    in_flight = (schema_id, verbatim, opts.strategy) if auto else None
    if in_flight:
        IN_FLIGHT.begin(*in_flight)
    return Started(job_id, schema_id, created_at, fields, request, time.monotonic(), in_flight, pieces)


def finish_job(sessions, settings: Settings, job: Started, future: Future, token: str) -> int:
    """Store a job's outcome and its stats together; 1 if stored, 0 if cancelled, deleted or taken over
    (or the database stayed unavailable, or the engine loop went down before it ended: then the
    job runs again after its lease)."""
    outcome = outcome_of(future, job.fields)
    if job.pieces is not None:
        PROGRESS.forget(job.job_id)
        if outcome is not None:
            outcome["partial"] = job.pieces.close()
    duration_s = round(time.monotonic() - job.started, 4)
    tries = []

    def store() -> bool:
        with sessions.begin() as session:
            repo = JobRepository(session)
            if tries and repo.stored_by(job.job_id, token):  # the last try committed; its reply was lost
                return True
            tries.append(1)
            ok = repo.store(job.job_id, token, **outcome)
            if ok and outcome.get("stats"):  # same transaction: a stored result and its stats commit together
                StatsRepository(session).record(job.schema_id, outcome["stats"], half_life=settings.stats_half_life,
                                                latency_s=(utcnow() - job.created_at).total_seconds())
            return ok

    try:
        if outcome is None:  # not the job's doing; the watchdog ends this process (worker/watchdog.py)
            log.error("the job did not end: %s; it runs again once its lease runs out", future.exception(),
                      extra=job.fields)
            return 0
        ok = retrying(store, what=f"storing job {job.job_id}", budget_s=settings.job_lease_s)
    except Exception as e:
        log.error("could not store the job's outcome; it runs again once its lease runs out: %s", preview(e),
                  extra=job.fields)
        ok = False
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
        log.info("job finished but not stored (cancelled, deleted or lease lost)", extra=info)
    elif outcome["status"] == "succeeded":
        log.info("job finished", extra=info)
    else:
        log.warning("job failed", extra={**info, "error": preview(outcome.get("error"))})


def outcome_of(future: Future, fields: dict[str, str]) -> dict[str, Any] | None:
    """The engine's answer as columns for JobRepository.store; None when the engine loop went
    down before the job ended (it has no outcome). Never raises."""
    from structspec.engine.loop import EngineLoopDown
    from structspec.engine.prompt import DocumentTooLong
    from structspec.grammar import SchemaError

    try:
        res = future.result()
    except EngineLoopDown:
        return None
    except (SchemaError, DocumentTooLong, ValueError, Overdue) as e:  # refused at submission, or never answered
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
        # the text as the model wrote it (the suffix proposer's memory after a restart); a merge of
        # chunks was not written by the model in one piece
        output = res.text if res.stats.stop_reason != "chunks" else None
        return {"status": "succeeded", "result": res.value, "stats": stats, "spans": res.spans,
                "confidence": res.confidence, "output": output}
    return {"status": "failed", "error": f"{res.status}: {res.error}", "stats": stats}


class LeaseKeeper:
    """Renews the leases held by `token` every lease/3 seconds from start() to stop(), so a long
    job is never mistaken for one whose worker died; a watched job that is no longer held
    (cancelled or deleted through the API, or taken over) gets its callback, which stops it in the engine.
    Once `halt` is called (the engine watchdog: engine_hung) no keeper of the process renews again."""

    _halted = threading.Event()  # for the whole process, never cleared

    @classmethod
    def halt(cls) -> None:
        cls._halted.set()

    def __init__(self, sessions, token: str, lease_s: float):
        self.sessions, self.token, self.lease_s = sessions, token, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._watched: dict[uuid.UUID, Callable[[], None]] = {}
        self._lock = threading.Lock()

    def watch(self, job_id: uuid.UUID, on_lost: Callable[[], None]) -> None:
        with self._lock:
            self._watched[job_id] = on_lost

    def start(self) -> "LeaseKeeper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(max(self.lease_s / 3, 0.5)):
            if self._halted.is_set():
                return
            try:
                with self.sessions.begin() as session:
                    repo = JobRepository(session)
                    repo.renew(self.token, self.lease_s)
                    held = repo.held_ids(self.token)
            except Exception as e:  # transient: the next round tries again (a lease outlives two misses)
                log.warning("lease renewal failed: %s", preview(e))
                continue
            with self._lock:
                lost = [(j, cb) for j, cb in self._watched.items() if j not in held]
                for j, _ in lost:
                    del self._watched[j]
            for _, on_lost in lost:  # finished jobs are not held either: stopping those is a no-op
                on_lost()


def engine_hung(settings: Settings, reason: str) -> None:
    """The engine watchdog's verdict (worker/watchdog.py): this process's leases are no longer
    renewed, so its jobs go back to the queue once they run out, and the process exits with
    EXIT_ENGINE_HUNG for its supervisor. os._exit, since the task threads blocked on the engine's
    answers (and Celery's shutdown, which would wait for them) must not keep it alive."""
    LeaseKeeper.halt()
    try:
        log.critical("engine watchdog: %s (STRUCTSPEC_ENGINE_WATCHDOG_S=%d); this worker no longer renews its "
                     "leases (its jobs run again once they run out) and exits with status %d for its supervisor to "
                     "restart it", reason, settings.engine_watchdog_s, EXIT_ENGINE_HUNG)
        for handler in logging.getLogger().handlers:
            handler.flush()
    finally:  # a log stream that fails must not keep the process alive
        os._exit(EXIT_ENGINE_HUNG)


# --- reaper: every job ends ------------------------------------------------------------------

def reap(settings: Settings, sessions) -> int:
    """One round: re-queue and re-publish jobs still `running` past their lease, fail those
    out of attempts, and re-publish stranded `queued` jobs. Publishing happens before the
    commit, so a failed publish leaves the jobs as they were for the next round. Returns how
    many jobs were re-published or failed."""
    token = "reaper-" + uuid.uuid4().hex[:16]
    with sessions.begin() as session:
        repo = JobRepository(session)
        requeued, failed = repo.requeue_expired(token, settings.job_max_attempts, settings.job_lease_s)
        if requeued:
            enqueue(app, requeued, chunk_size=1)  # each runs alone (Isolation): one per message
        refs = repo.refs(requeued + failed)
    for job_id in requeued:
        log.warning("job re-queued: its lease expired (worker lost)", extra=_ref_fields(job_id, refs))
    for job_id in failed:
        log.error("job failed: its lease expired %d times (worker lost each time)", settings.job_max_attempts,
                  extra={**_ref_fields(job_id, refs), "status": "failed"})
    if requeued:
        log.warning("re-queued %d job(s) whose lease expired", len(requeued), extra={"count": len(requeued)})
    return len(requeued) + len(failed) + republish_stranded(settings, sessions)


def republish_stranded(settings: Settings, sessions) -> int:
    """Publish again the `queued` jobs whose message went out more than job_republish_after_s
    ago, but only while the broker's queue is empty: with a backlog their messages are most
    likely still waiting in it, and publishing copies would only grow it. (A copy of a message
    that was not lost after all is harmless: its claim finds the job taken or finished.)"""
    return _republish(settings, sessions, reading=False) + _republish(settings, sessions, reading=True)


def _republish(settings: Settings, sessions, reading: bool) -> int:
    """republish_stranded for the model's queue, or (`reading`) for the ingest queue's jobs,
    whose file is still to be read (a reader that died left its lease to run out)."""
    if queue_depth(app, settings.ingest_queue if reading else settings.job_queue) > 0:
        return 0
    token = "reaper-" + uuid.uuid4().hex[:16]
    with sessions.begin() as session:
        repo = JobRepository(session)
        first, later = repo.claim_stranded(token, settings.job_republish_after_s, reading=reading)
        if reading and first + later:
            enqueue_reads(app, first + later)
        if not reading and first:
            enqueue(app, first)
        if not reading and later:
            enqueue(app, later, chunk_size=1)  # each runs alone (Isolation): one per message
        ids = first + later
        refs = repo.refs(ids)
    for job_id in ids:
        log.warning("job published again%s: still queued %d s after its message went out, with the queue empty "
                    "(message lost, or its reader died)", " to have its file read" if reading else "",
                    settings.job_republish_after_s, extra=_ref_fields(job_id, refs))
    return len(ids)


def _ref_fields(job_id: uuid.UUID, refs: dict) -> dict[str, str]:
    schema_id, batch_id = refs.get(job_id, (None, None))
    return {"job_id": str(job_id), "schema_id": str(schema_id), **({"batch_id": str(batch_id)} if batch_id else {})}


class Reaper:
    """Runs `reap` at worker start and then every min(job_lease_s, job_republish_after_s) / 2
    seconds (at least 1 s), with the batch webhooks that are due (worker/webhooks.py); and the
    retention sweep (worker/retention.py) at start and then hourly, or at the next round after a
    sweep that failed or left a backlog."""

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
        interval = max(min(self.settings.job_lease_s, self.settings.job_republish_after_s) / 2, 1.0)
        next_purge = 0.0
        while True:
            try:
                reap(self.settings, sessions)
            except Exception as e:
                log.warning("reaper round failed: %s", e)
            try:
                deliver_webhooks(self.settings, sessions)
            except Exception as e:
                log.warning("webhook round failed: %s", preview(e))
            if time.monotonic() >= next_purge:
                try:
                    more = purge_expired(self.settings, sessions).more
                    next_purge = time.monotonic() + (0 if more else PURGE_EVERY_S)  # a backlog: on at the next round
                except Exception as e:
                    log.warning("retention sweep failed: %s", preview(e))
            if self._stop.wait(interval):
                return


_REAPER: Reaper | None = None


@worker_ready.connect
def _on_ready(sender=None, **_) -> None:
    global _REAPER
    settings = app.structspec_settings
    _REAPER = Reaper(settings)
    _REAPER.start()
    if not PROCESS.forking and not PROCESS.reads_only:  # loaded already by `structspec worker`; `celery worker` here
        PROCESS.loop(settings)


@worker_process_init.connect
def _on_child(**_) -> None:
    """A prefork pool's child process, just forked."""
    PROCESS.after_fork(app.structspec_settings)


@worker_shutdown.connect
def _on_shutdown(**_) -> None:
    if _REAPER is not None:
        _REAPER.stop()
