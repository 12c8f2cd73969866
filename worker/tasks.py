"""Job tasks: take job ids, claim them in the database, run the engine, store results.

The engine is loaded once per worker process (lazily, or eagerly at worker start) and
reused by every task. Tasks get ids, never ORM objects, and are idempotent: a job that is
finished, cancelled or held by a live lease is skipped, so redelivered or duplicated messages
are harmless.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import traceback
import uuid
from typing import Any

from celery import Task
from celery.signals import worker_process_init, worker_ready, worker_shutdown

from structspec.config import Settings
from structspec.db.columns import utcnow
from structspec.db.jobs import JobRepository
from structspec.db.stats import StatsRepository
from structspec.db.repositories import SchemaRepository
from structspec.db.session import make_engine, make_session_factory
from structspec.grammar.verbatim import uses_verbatim
from structspec.logs import preview
from structspec.stats.resolve import resolve_options
from worker.app import RUN_JOBS, app, enqueue

log = logging.getLogger("structspec.worker")

# The running job's ids, for log lines from inside the extraction (e.g. a crash).
_JOB_FIELDS: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("structspec_job", default={})
LOGGED_STATS = ("strategy", "draft_len", "output_tokens", "target_passes", "acceptance_rate", "prefill_s",
                "decode_s", "stop_reason")


class _Process:
    """What one worker process holds: the model engine and a database session factory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine = None
        self._sessions = None

    def engine(self, settings: Settings):
        with self._lock:
            if self._engine is None:
                from structspec.engine.engine import Engine

                settings.apply_torch_threads()
                log.info("loading model %r", settings.model)
                self._engine = Engine.from_settings(settings)
            return self._engine

    def sessions(self, settings: Settings):
        with self._lock:
            if self._sessions is None:
                self._sessions = make_session_factory(make_engine(settings.database_url))
            return self._sessions

    def reset_after_fork(self) -> None:
        self._sessions = None  # never share pooled connections across fork


PROCESS = _Process()


def prepare_model(settings: Settings, *, load: bool) -> None:
    """Before the worker consumes anything: load the model into this process (`load`, the solo
    pool) or check that its config and tokenizer load (prefork: the children load the weights).
    Raises ModelLoadError naming the model, so a worker that cannot run jobs never takes one."""
    if load:
        PROCESS.engine(settings)
        return
    from transformers import AutoConfig, AutoTokenizer

    from structspec.engine.model import ModelLoadError, model_dir

    path, _ = model_dir(settings.model, settings.cache_dir)
    try:
        AutoConfig.from_pretrained(path)
        AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load model {settings.model!r} from {path}: {e}") from e


class JobTask(Task):
    """Base task: settings from the app, engine and sessions from this process."""

    @property
    def settings(self) -> Settings:
        return self.app.structspec_settings


@app.task(name=RUN_JOBS, base=JobTask, bind=True, acks_late=True, reject_on_worker_lost=True,
          ignore_result=True)
def run_jobs(self: JobTask, job_ids: list[str]) -> dict[str, int]:
    """Run a chunk of jobs. Returns counts (for logs): claimed, stored."""
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
    stored = 0
    with LeaseKeeper(sessions, token, settings.job_lease_s):
        for job_id in claimed:
            stored += run_one(sessions, settings, job_id, token)
    return {"claimed": len(claimed), "stored": stored}


def run_one(sessions, settings: Settings, job_id: uuid.UUID, token: str) -> int:
    """Run one held job and store its outcome; 1 if stored, 0 if cancelled/taken over meanwhile."""
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
        options = dict(job.options)
        try:
            with session.begin_nested():  # a failed read must not poison this transaction
                options = resolve_options(session, settings, schema_id, job_id, options,
                                          verbatim=uses_verbatim(schema, bool(options.get("verbatim"))))
        except Exception:  # never strand a job on the selector: fall back to the fixed default
            log.exception("strategy selection failed; using %s", settings.strategy, extra=fields)
            options.update(strategy=settings.strategy, draft_len=options.get("draft_len") or settings.draft_len)
    log.info("job started", extra={**fields, "strategy": options.get("strategy"),
                                   "draft_len": options.get("draft_len"), "attempt": attempt,
                                   "queued_s": queued_s, "document_chars": len(document)})
    started = time.monotonic()
    token_fields = _JOB_FIELDS.set(fields)
    try:
        outcome = extract(settings, schema, document, options)
    finally:
        _JOB_FIELDS.reset(token_fields)
    duration_s = round(time.monotonic() - started, 4)
    with sessions.begin() as session:
        ok = JobRepository(session).store(job_id, token, **outcome)
        if ok and outcome.get("stats"):  # same transaction: a stored result and its stats commit together
            StatsRepository(session).record(schema_id, outcome["stats"], half_life=settings.stats_half_life,
                                            latency_s=(utcnow() - created_at).total_seconds())
    log_outcome(fields, outcome, duration_s, ok)
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


def extract(settings: Settings, schema: dict, document: str, options: dict[str, Any]) -> dict[str, Any]:
    """The engine's answer as columns for JobRepository.store; never raises for bad input."""
    from structspec.engine.engine import ExtractOptions
    from structspec.engine.prompt import DocumentTooLong
    from structspec.grammar import SchemaError

    try:
        res = PROCESS.engine(settings).extract(schema, document, ExtractOptions(**options))
    except (SchemaError, DocumentTooLong, ValueError) as e:
        return {"status": "failed", "error": str(e)}
    except Exception as e:  # a bug or resource problem: fail the job visibly, keep the worker
        # The message may quote the document: a preview of it, and the stack without it.
        log.error("extraction crashed: %s: %s", type(e).__name__, preview(e),
                  extra={**_JOB_FIELDS.get(), "stack": "".join(traceback.format_tb(e.__traceback__))[-1900:]})
        return {"status": "failed", "error": f"internal error: {type(e).__name__}: {e}"[:2000]}
    stats = res.stats.as_dict()
    if res.status == "succeeded":
        return {"status": "succeeded", "result": res.value, "stats": stats}
    return {"status": "failed", "error": f"{res.status}: {res.error}", "stats": stats}


class LeaseKeeper:
    """Renews the leases held by `token` every lease/3 seconds while the block runs, so a long
    job is never mistaken for one whose worker died."""

    def __init__(self, sessions, token: str, lease_s: float):
        self.sessions, self.token, self.lease_s = sessions, token, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

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
                    JobRepository(session).renew(self.token, self.lease_s)
            except Exception:
                log.exception("lease renewal failed")


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


@worker_process_init.connect
def _load_in_child(**_) -> None:
    """Prefork children: fresh DB connections, then the model, before the first task."""
    PROCESS.reset_after_fork()
    PROCESS.engine(app.structspec_settings)


@worker_ready.connect
def _on_ready(sender=None, **_) -> None:
    global _REAPER
    settings = app.structspec_settings
    _REAPER = Reaper(settings)
    _REAPER.start()
    if "solo" in type(getattr(sender, "pool", None)).__module__:
        PROCESS.engine(settings)  # solo pool: tasks run in this process; load before the first one


@worker_shutdown.connect
def _on_shutdown(**_) -> None:
    if _REAPER is not None:
        _REAPER.stop()
