"""Reading files: the ingest queue's task.

A document sent as a file (a PDF, an image) is stored by the API with its bytes and phase
"reading", and its id published to STRUCTSPEC_INGEST_QUEUE. A worker consuming that queue
(`structspec worker` starts one beside the model's; `--queues ingest` runs only it, on a box
with no model) takes the job for the read with a lease, reads the file in a child process held
to the decoders' budgets (structspec.ingest.read_isolated: pixels, pages, seconds, memory), and
then either stores the text and publishes the job to the model's queue, or fails the job with
the reason, its code first (`file_unreadable: the PDF cannot be read ...`).

What can go wrong and what happens:
  - the reader dies mid-read (the file crashed or exhausted it, or the machine went): its lease
    runs out, the reaper publishes the job to the ingest queue again, and after
    STRUCTSPEC_JOB_MAX_ATTEMPTS reads the job fails (`read_crashed`) instead of killing readers
    for ever;
  - the job was cancelled or deleted meanwhile: nothing is stored;
  - the model queue is unreachable after the read: the job stays queued with its text, and
    the reaper publishes it (job_republish_after_s), as for any lost message.
Like run_jobs this is idempotent (a conditional claim), so redelivered messages are harmless.
"""

from __future__ import annotations

import logging
import time
import uuid

from celery import Task

from structspec.config import Settings
from structspec.db.files import FileRepository
from structspec.db.jobs import JobRepository
from structspec.db.retry import retrying
from structspec.logs import preview, safe_traceback
from structspec.worker.app import READ_FILES, app, enqueue

log = logging.getLogger("structspec.worker.ingest")

# the read lease outlasts the longest read (ingest_timeout_s) by this much: fetching the bytes
# and storing the text
READ_LEASE_MARGIN_S = 60


def read_lease_s(settings: Settings) -> float:
    return settings.ingest_timeout_s + READ_LEASE_MARGIN_S


class ReadTask(Task):
    @property
    def settings(self) -> Settings:
        return self.app.structspec_settings


@app.task(name=READ_FILES, base=ReadTask, bind=True, acks_late=True, reject_on_worker_lost=True,
          ignore_result=True)
def read_files(self: ReadTask, job_ids: list[str]) -> dict[str, int]:
    """Read the file of each job in `job_ids` (one per message, as enqueue_reads sends them);
    returns counts (for logs)."""
    from structspec.worker.tasks import PROCESS  # the process's session factory (no engine is built by it)

    settings = self.settings
    sessions = PROCESS.sessions(settings)
    counts = {"read": 0, "failed": 0, "skipped": 0}
    for raw in job_ids:
        counts[read_one(sessions, settings, uuid.UUID(raw))] += 1
    return counts


def read_one(sessions, settings: Settings, job_id: uuid.UUID) -> str:
    """_read_one, with a bug or an unforeseen error failing the job visibly (its lease held, it
    would otherwise wait out its lease and its attempts)."""
    token = "reader-" + uuid.uuid4().hex[:16]
    try:
        return _read_one(sessions, settings, job_id, token)
    except Exception as e:
        log.error("reading the file crashed: %s: %s", type(e).__name__, preview(e),
                  extra={"job_id": str(job_id), "stack": safe_traceback((type(e), e, e.__traceback__))})
        return _fail(sessions, settings, job_id, token, {"job_id": str(job_id)}, None,
                     f"internal error: {type(e).__name__} while reading the file")


def _read_one(sessions, settings: Settings, job_id: uuid.UUID, token: str) -> str:
    """Read one job's files: "read" (handed to the model's queue), "failed" or "skipped".

    The job's `intake["files"]` lists them: each an uploaded file (`file_id`) or a slice of the
    job's `source` (`offset`, `length`), with the media type and name given. An extraction job has
    one, whose text becomes its document (with its layout: the boxes); a chat job's files each
    replace the content part at `at` ([message, part]) of its messages, and its document is then
    the messages' text, as for a chat request without files."""
    from structspec.ingest import IngestError, Limits, encode_layout, read_isolated

    fields = {"job_id": str(job_id)}

    def claim():
        with sessions.begin() as session:
            repo = JobRepository(session)
            state = repo.claim_read(job_id, token, read_lease_s(settings), settings.job_max_attempts)
            if state != "claimed":
                return state, None
            job = repo.reading(job_id, token)
            fields.update(schema_id=str(job.schema_id), **({"batch_id": str(job.batch_id)} if job.batch_id else {}))
            files = FileRepository(session, job.tenant)
            found = []
            for entry in (job.intake or {}).get("files", []):
                if "file_id" in entry:
                    data = files.content(entry["file_id"]) if files.get(entry["file_id"]) is not None else None
                else:
                    data = (job.source or b"")[entry["offset"]:entry["offset"] + entry["length"]]
                found.append((entry, data))
            return state, (found, job.messages)

    try:
        state, found = retrying(claim, what=f"claiming job {job_id} to read its file", budget_s=settings.job_lease_s)
    except Exception as e:  # the job stays queued; the reaper publishes it again
        log.error("could not claim the job to read its file: %s", preview(e), extra=fields)
        return "skipped"
    if state == "skip":
        log.info("file read skipped: the job is cancelled, deleted, read or being read", extra=fields)
        return "skipped"
    if state == "exhausted":
        return _fail(sessions, settings, job_id, token, fields, "read_crashed",
                     f"the process reading this file died {settings.job_max_attempts} times (it was killed, crashed "
                     "or ran out of memory); not read again (STRUCTSPEC_JOB_MAX_ATTEMPTS)")
    entries, messages = found
    limits, started, docs = Limits.from_settings(settings), time.monotonic(), []
    for n, (entry, data) in enumerate(entries):
        where = f"messages.{entry['at'][0]}.content.{entry['at'][1]}: " if "at" in entry else ""
        if data is None:
            return _fail(sessions, settings, job_id, token, fields, "file_missing",
                         f"{where}the uploaded file {entry.get('file_id')} was deleted before it was read")
        try:
            docs.append(read_isolated(data, entry.get("media_type"), entry.get("name"), limits=limits))
        except IngestError as e:
            return _fail(sessions, settings, job_id, token, {**fields, "bytes": len(data), "file": n}, e.code,
                         f"{where}{e}")
    if messages is None:
        [doc] = docs
        text, layout, warnings = doc.text, encode_layout(doc), list(doc.warnings)
    else:
        from structspec.engine.prompt import chat_messages, messages_text

        # stored as content parts (checked by the API); each file's text goes into its part
        messages = [dict(m, content=list(m["content"])) if isinstance(m.get("content"), list) else dict(m)
                    for m in messages]
        for (entry, _), doc in zip(entries, docs):
            i, j = entry["at"]
            messages[i]["content"][j] = {"type": "text", "text": doc.text}
        messages = chat_messages(messages)  # as a chat request without files stores them: text content
        text, layout, warnings = messages_text(messages), None, [w for doc in docs for w in doc.warnings]
    size, limit = len(text.encode("utf-8", "surrogatepass")), settings.max_document_bytes
    if size > limit:
        return _fail(sessions, settings, job_id, token, fields, "file_too_large",
                     f"the text read from the file is {size} bytes; the limit is {limit} bytes (max_document_bytes)")

    def store() -> bool:
        with sessions.begin() as session:
            return JobRepository(session).read_done(job_id, token, text, layout, warnings, messages)

    try:
        stored = retrying(store, what=f"storing the text read for job {job_id}", budget_s=settings.job_lease_s)
    except Exception as e:  # the lease runs out; the reaper publishes the job to be read again
        log.error("could not store the text read from the file: %s", preview(e), extra=fields)
        return "skipped"
    info = {**fields, "files": len(docs), "bytes": sum(len(d) for _, d in entries),
            "pages": sum(len(doc.pages) for doc in docs), "ocr_pages": sum(p.ocr for doc in docs for p in doc.pages),
            "chars": len(text), "warnings": len(warnings), "read_s": round(time.monotonic() - started, 3)}
    if not stored:
        log.info("file read, not stored: the job was cancelled or deleted meanwhile", extra=info)
        return "skipped"
    try:
        enqueue(app, [job_id])
    except Exception as e:  # stored and queued: the reaper publishes it (job_republish_after_s)
        log.warning("file read; the job queue is unreachable, the reaper will publish the job: %s", preview(e),
                    extra=info)
    log.info("file read", extra=info)
    return "read"


def _fail(sessions, settings: Settings, job_id: uuid.UUID, token: str, fields: dict, code: str | None,
          message: str) -> str:
    """Fail the job held by `token` with `code: message` (a code of structspec.ingest.FILE_ERRORS;
    None: an internal error, the message alone)."""
    error = f"{code}: {message}" if code else message

    def store() -> bool:
        with sessions.begin() as session:
            return JobRepository(session).read_failed(job_id, token, error[:2000])

    try:
        stored = retrying(store, what=f"failing job {job_id}", budget_s=settings.job_lease_s)
    except Exception as e:
        log.error("could not store that the file cannot be read: %s", preview(e), extra=fields)
        return "skipped"
    log.warning("job failed: its file cannot be read", extra={**fields, "status": "failed", "code": code,
                                                              "stored": stored})
    return "failed"
