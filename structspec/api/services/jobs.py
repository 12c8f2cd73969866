"""Extraction jobs and batches: validate, store, publish to the broker, read back, list,
cancel, delete.

Submission order: the rows are committed first, then the job ids are published; if the
broker does not take them within submit_timeout_s the rows are deleted again and the client
gets 503, so nothing half-written stays behind. (A crash of the API process between commit
and publish would leave jobs queued with no message: the one gap, see docs/api.md.)
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import anyio
import msgspec
import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from structspec.api.errors import (ApiError, ErrorItem, NotFoundError, PayloadTooLargeError, UnprocessableError,
                                   from_registry)
from structspec.api.services.content import ChatFiles, Submitted, decode_base64, submitted_file
from structspec.api.services.doclen import DocumentLengthChecker
from structspec.api.services.waiting import JobWaiter
from structspec.api.structs import (BatchAccepted, BatchCreate, BatchPage, BatchRead, ExtractionCreate, JobAccepted,
                                    JobOptions, JobPage, JobRead, JobStats, JobSummary, JobTimings, PageBox, Rejected)
from structspec.config import Settings
from structspec.db.columns import utcnow
from structspec.db.files import DOCUMENT_PURPOSE
from structspec.db.idempotency import IdempotencyRepository
from structspec.db.jobs import BatchRepository, JobRepository
from structspec.db.models import DEFAULT_TENANT, TERMINAL_STATUSES, BatchRecord, JobRecord
from structspec.logs import preview
from structspec.options import OptionError, RequestOptions
from structspec.services.batches import to_batch_read
from structspec.services.schemas import RegistryError, SchemaRegistry
from structspec.services.webhooks import url_problem

log = logging.getLogger(__name__)

RESULTS_PAGE = 500
DOC_ID_CHARS = 200  # a batch document's id as stored (JSON text, jobs.doc_id)
ENTRY_FIELDS = frozenset({"id", "document", "content", "file_id", "media_type"})  # of a batch entry


@dataclass(frozen=True)
class Idempotency:
    """A submission's Idempotency-Key header and the fingerprint of its request (route and
    content): the same key with another request is refused, never answered with old jobs."""

    key: str
    fingerprint: str

    @classmethod
    def of(cls, key: str | None, route: str, *parts: bytes) -> "Idempotency | None":
        if key is None:
            return None
        digest = hashlib.sha256(route.encode())
        for part in parts:
            digest.update(len(part).to_bytes(8, "big") + part)
        return cls(key, digest.hexdigest())


@dataclass(frozen=True)
class Webhook:
    """A batch's webhook_url as submitted, and where it came from (for the 422 naming it)."""

    url: str
    path: str
    source: str

    def check(self, hosts_setting: str) -> None:
        """422 unless STRUCTSPEC_WEBHOOK_HOSTS allows the URL (structspec/services/webhooks.py)."""
        problem = url_problem(self.url, hosts_setting)
        if problem is not None:
            raise UnprocessableError(problem, [ErrorItem(path=self.path, message=problem, source=self.source)])


class JobService:
    """Jobs and batches of one tenant: another tenant's ids are unknown ids (404)."""

    def __init__(self, session_factory: sessionmaker[Session], settings: Settings, publisher,
                 doclen: DocumentLengthChecker | None = None, tenant: str = DEFAULT_TENANT):
        self.session_factory = session_factory
        self.settings = settings
        self.publisher = publisher  # a Celery app (worker.app.make_celery)
        self.doclen = doclen  # None: only the worker checks document length in tokens
        self.tenant = tenant

    # --- single extractions --------------------------------------------------------------------

    def submit(self, data: ExtractionCreate, idem: Idempotency | None = None) -> tuple[JobAccepted, bool]:
        """The queued job, and whether this answer replays an earlier submission's (`idem`)."""
        if (first := self.replay(idem)) is not None:
            return msgspec.convert(first, JobAccepted), True
        # everything is checked before an inline schema is registered: a refused request stores nothing
        document, where = self.document_of(data)
        options = self.request_options(data.options)
        if not document.to_read:  # a file's text is known once a worker has read it; it checks it then
            self.check_document(document.text, where)
            [too_long] = self._token_problems(self.schema_body(data.schema_id, data.schema), [document.text], options)
            if too_long:
                raise UnprocessableError(too_long, [ErrorItem(path=where, message=too_long, source="body")])
        schema_id = self.resolve_schema(data.schema_id, data.schema)
        answer, replayed = self._queue_one(schema_id, document, options, idem=idem)
        return msgspec.convert(answer, JobAccepted), replayed

    def document_of(self, data: ExtractionCreate) -> tuple[Submitted, str]:
        """(the document as submitted, the body path it came from): `document` (text), `content`
        (a file, base64: checked here, read by a worker) or `file_id` (an uploaded file). Exactly
        one is given."""
        from structspec.ingest import IngestError

        given = [name for name in ("document", "content", "file_id") if getattr(data, name) is not None]
        if len(given) != 1:
            message = (f"give the document one way, not {' and '.join(f'`{g}`' for g in given)}" if given else
                       "`document` (text), `content` (a file, base64) or `file_id` (an uploaded file) is required")
            raise UnprocessableError(message, [ErrorItem(path="/document", message=message, source="body")])
        if data.document is not None:
            return Submitted(text=data.document), "/document"
        if data.file_id is not None:
            problem = self.file_problems([data.file_id]).get(data.file_id)
            if problem:
                raise ApiError(404 if problem.startswith("no file") else 422, f"file_id: {problem}",
                               [ErrorItem(path="/file_id", message=problem, source="body")])
            return Submitted(file_id=data.file_id, media_type=data.media_type), "/file_id"
        try:
            return submitted_file(decode_base64(data.content), data.media_type, self.limits), "/content"
        except IngestError as e:
            raise ApiError(e.status, f"content: {e}", [ErrorItem(path="/content", message=str(e), source="body")]) \
                from None

    @property
    def limits(self):
        """The decoders' budgets (structspec.ingest.Limits) from the settings."""
        from structspec.ingest import Limits

        return Limits.from_settings(self.settings)

    def file_problems(self, file_ids: list[str]) -> dict[str, str]:
        """{file id: why it cannot be extracted from} for those of `file_ids` that are not this
        tenant's uploaded documents (unknown, or uploaded for another purpose)."""
        from structspec.db.models import FileRecord

        if not file_ids:
            return {}
        with self.session_factory() as session:
            found = dict(session.execute(sa.select(FileRecord.id, FileRecord.purpose).where(
                FileRecord.id.in_(set(file_ids)), FileRecord.tenant == self.tenant)).all())
        problems = {}
        for file_id in file_ids:
            if file_id not in found:
                problems[file_id] = f"no file with id {file_id}"
            elif found[file_id] != DOCUMENT_PURPOSE:
                problems[file_id] = (f"file {file_id} has purpose {found[file_id]!r}; a document is uploaded with "
                                     f"purpose {DOCUMENT_PURPOSE}")
        return problems

    def _queue_one(self, schema_id: uuid.UUID, document: str | Submitted | ChatFiles, options: RequestOptions,
                   messages: list[dict[str, str]] | None = None, stream: bool = False,
                   idem: Idempotency | None = None) -> tuple[dict[str, Any], bool]:
        """Store one queued job and publish it, to the ingest queue when its file is to be read
        (deleted again if the broker is down); returns the answer {id, status} and whether it is
        a concurrent first submission's (`idem`)."""
        document = Submitted(text=document) if isinstance(document, str) else document
        row = dict(tenant=self.tenant, schema_id=schema_id, messages=messages, options=options.as_dict(),
                   stream=stream, **document.columns())

        def write(session: Session) -> dict[str, Any]:
            [job_id] = JobRepository(session).add_many([row])
            return {"id": str(job_id), "status": "queued"}

        answer, replayed = self.store_once(idem, write)
        if replayed:
            return answer, True
        job_id = uuid.UUID(answer["id"])
        self.publish([job_id], [row], undo=lambda s: (JobRepository(s).delete_many([job_id]), self.forget(s, idem)),
                     what={"job_id": job_id, "schema_id": schema_id})
        size = {"files_to_read": len(getattr(document, "files", [document]))} if document.to_read else \
            {"document_chars": len(document.text)}
        log.info("job submitted", extra={"job_id": str(job_id), "schema_id": str(schema_id), "tenant": self.tenant,
                                         "strategy": options.strategy, **size,
                                         **({"chat": True} if messages is not None else {})})
        return answer, False

    def replay(self, idem: Idempotency | None) -> dict[str, Any] | None:
        """The answer stored for `idem`'s key within the last day, or None; 422 when that key
        came with a different request."""
        if idem is None:
            return None
        with self.session_factory.begin() as session:
            first = IdempotencyRepository(session, self.tenant).live(idem.key)
            if first is None:
                return None
            if first.fingerprint != idem.fingerprint:
                raise UnprocessableError(
                    f"Idempotency-Key {idem.key!r} was used in the last 24 hours for a different request; "
                    "send a new key with a new request",
                    [ErrorItem(path="Idempotency-Key", message="reused with a different request", source="header")])
            log.info("submission replayed", extra={"idempotency_key": preview(idem.key, 80), "tenant": self.tenant,
                                                   **{k: first.response[k] for k in ("id",) if k in first.response}})
            return first.response

    def store_once(self, idem: Idempotency | None,
                    write: Callable[[Session], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
        """Run `write` (it stores rows and returns the answer) in one transaction with `idem`'s
        key: (answer, False); or, when a concurrent request with the same key stored its rows
        first, nothing is stored and its answer comes back: (answer, True)."""
        try:
            with self.session_factory.begin() as session:
                answer = write(session)
                if idem is not None:
                    IdempotencyRepository(session, self.tenant).add(idem.key, idem.fingerprint, answer)
            return answer, False
        except IntegrityError:
            if idem is None or (first := self.replay(idem)) is None:
                raise
            return first, True

    def forget(self, session: Session, idem: Idempotency | None) -> None:
        """Undo part of a submission the broker did not take: its key goes with its jobs."""
        if idem is not None:
            IdempotencyRepository(session, self.tenant).delete(idem.key)

    def get(self, job_id: str) -> JobRead:
        with self.session_factory() as session:
            return to_job_read(self._job(session, job_id))

    def cancel(self, job_id: str) -> JobRead:
        with self.session_factory.begin() as session:
            repo = JobRepository(session)
            job = self._job(session, job_id)
            if not repo.cancel(job.id):
                session.refresh(job)
                raise ApiError(409, f"job {job.id} is already {job.status}; only queued or running jobs "
                                    "can be cancelled",
                               [ErrorItem(path="id", message=f"status is {job.status}", source="path")])
            session.refresh(job)
            log.info("job cancelled", extra=job_fields(job, status=job.status))
            return to_job_read(job)

    def list(self, *, limit: int, offset: int, status: str | None = None, batch_id: uuid.UUID | None = None,
             schema_id: uuid.UUID | None = None) -> JobPage:
        """The tenant's jobs, newest first, as summaries."""
        with self.session_factory() as session:
            page, total = JobRepository(session).page(self.tenant, limit=limit, offset=offset, status=status,
                                                      batch_id=batch_id, schema_id=schema_id)
            items = [JobSummary(id=j.id, status=j.status, phase=j.phase, schema_id=j.schema_id, batch_id=j.batch_id,
                                error=j.error, created_at=j.created_at, finished_at=j.finished_at) for j in page]
        return JobPage(items=items, total=total, limit=limit, offset=offset)

    def delete(self, job_id: str) -> None:
        """Delete a job with its document and result, whatever its status (a queued or running
        one is stopped as by a cancel); 409 for a job of a batch, which goes with its batch."""
        with self.session_factory.begin() as session:
            job = self._job(session, job_id)
            if job.batch_id is not None:
                raise ApiError(409, f"job {job.id} belongs to batch {job.batch_id}; delete the batch instead "
                                    f"(DELETE /v1/batches/{job.batch_id})",
                               [ErrorItem(path="id", message=f"in batch {job.batch_id}", source="path")])
            JobRepository(session).delete_many([job.id])
            log.info("job deleted", extra=job_fields(job, status=job.status))

    # --- batches -------------------------------------------------------------------------------

    def submit_batch_json(self, data: BatchCreate, idem: Idempotency | None = None) -> tuple[BatchAccepted, bool]:
        """The stored batch, and whether this answer replays an earlier submission's (`idem`)."""
        entries = [(i + 1, raw, None) for i, raw in enumerate(data.documents)]
        webhook = Webhook(data.webhook_url, "/webhook_url", "body") if data.webhook_url is not None else None
        return self._submit_batch(data.schema_id, data.options, entries, where="/documents/{i}", idem=idem,
                                  webhook=webhook)

    def submit_batch_ndjson(self, body: bytes, schema_id: str | None, options: JobOptions,
                            idem: Idempotency | None = None, webhook_url: str | None = None
                            ) -> tuple[BatchAccepted, bool]:
        if not schema_id:
            raise UnprocessableError("query parameter schema_id is required for an NDJSON batch",
                                     [ErrorItem(path="schema_id", message="missing", source="query")])
        entries = []
        for n, line in enumerate(body.split(b"\n"), start=1):
            if not line.strip():
                continue
            try:
                entries.append((n, msgspec.json.decode(line), None))
            except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
                entries.append((n, None, f"not valid JSON: {e}"))
        webhook = Webhook(webhook_url, "webhook_url", "query") if webhook_url is not None else None
        return self._submit_batch(schema_id, options, entries, where="line {n}", idem=idem, webhook=webhook)

    def _submit_batch(self, schema_id_text: str, options_in: JobOptions | None,
                      entries: list[tuple[int, Any, str | None]], where: str,
                      idem: Idempotency | None, webhook: Webhook | None = None) -> tuple[BatchAccepted, bool]:
        if (first := self.replay(idem)) is not None:
            return msgspec.convert(first, BatchAccepted), True
        if webhook is not None:
            webhook.check(self.settings.webhook_hosts)
        limit = self.settings.max_batch_size
        if len(entries) > limit:
            raise PayloadTooLargeError(
                f"batch has {len(entries)} documents; the limit is {limit} (max_batch_size)",
                [ErrorItem(path="/documents", message=f"{len(entries)} > {limit}", source="body")])
        self._check_unique_ids(entries, where)
        schema_id = self.resolve_schema(schema_id_text, None)
        options = self.request_options(options_in)
        stored = options.as_dict()
        rows, rejected = [], []
        read = self._read_entries([(n, raw, problem or self._entry_problem(raw)) for n, raw, problem in entries])
        fine = [doc.text for _, _, problem, doc in read if not problem and not doc.to_read]
        too_long = iter(self._token_problems(self.schema_body(str(schema_id), None), fine, options))
        for n, raw, problem, doc in read:
            problem = problem or (None if doc.to_read else next(too_long))
            if problem:
                rejected.append(Rejected(line=n, message=problem))
                continue
            doc_id = raw.get("id", n - 1)
            rows.append(dict(tenant=self.tenant, schema_id=schema_id, options=stored, position=len(rows),
                             doc_id=msgspec.json.encode(doc_id).decode(), **doc.columns()))
        if not rows:
            raise UnprocessableError("no valid document in the batch", [
                ErrorItem(path=where.format(i=r.line - 1, n=r.line), message=r.message, source="body")
                for r in rejected[:100]])
        ids: list[uuid.UUID] = []

        def write(session: Session) -> dict[str, Any]:
            batch = BatchRepository(session).add(tenant=self.tenant, schema_id=schema_id, total=len(rows),
                                                 options=stored, webhook_url=webhook.url if webhook else None)
            for row in rows:
                row["batch_id"] = batch.id
            ids[:] = JobRepository(session).add_many(rows)
            return msgspec.to_builtins(BatchAccepted(id=batch.id, total=len(rows), rejected=rejected))

        answer, replayed = self.store_once(idem, write)
        accepted = msgspec.convert(answer, BatchAccepted)
        if replayed:
            return accepted, True
        self.publish(ids, rows, undo=lambda s: (BatchRepository(s).delete(accepted.id), self.forget(s, idem)),
                     what={"batch_id": accepted.id, "schema_id": schema_id})
        log.info("batch submitted", extra={"batch_id": str(accepted.id), "schema_id": str(schema_id),
                                           "tenant": self.tenant, "strategy": options.strategy, "jobs": len(rows),
                                           "files_to_read": sum(r.get("phase") == "reading" for r in rows),
                                           "rejected": len(rejected)})
        return accepted, False

    @staticmethod
    def _check_unique_ids(entries: list[tuple[int, Any, str | None]], where: str) -> None:
        """422 naming a document id given twice (results are keyed by it), with both places."""
        first: dict[str, int] = {}
        for n, raw, _ in entries:
            if not isinstance(raw, dict) or not isinstance(raw.get("id"), (str, int)) or isinstance(raw["id"], bool):
                continue
            key = msgspec.json.encode(raw["id"]).decode()
            if key in first:
                here, there = where.format(i=n - 1, n=n), where.format(i=first[key] - 1, n=first[key])
                message = f"document id {raw['id']!r} is given twice: {there} and {here}; ids must be unique"
                raise UnprocessableError(message, [ErrorItem(path=here if here.startswith("/") else None,
                                                             message=message, source="body")])
            first[key] = n

    def _entry_problem(self, raw: Any) -> str | None:
        """Why a batch entry cannot be taken as it is (its shape and sizes), or None."""
        if not isinstance(raw, dict):
            return ('expected an object {"id"?: string | integer, "document": string} or {"id"?, "content": '
                    'base64, "media_type"?: string}')
        unknown = sorted(set(raw) - ENTRY_FIELDS)
        if unknown:
            return f"unknown field {unknown[0]!r} (allowed: {', '.join(sorted(ENTRY_FIELDS))})"
        if "id" in raw and (isinstance(raw["id"], bool) or not isinstance(raw["id"], (str, int))):
            return "field 'id' must be a string or an integer"
        if "id" in raw and (size := len(msgspec.json.encode(raw["id"]).decode())) > DOC_ID_CHARS:
            return f"field 'id' is {size} characters as JSON; the limit is {DOC_ID_CHARS}"
        given = [name for name in ("document", "content", "file_id") if name in raw]
        if len(given) > 1:
            return (f"give the document one way: text ('document'), a file ('content', base64) or an uploaded file "
                    f"('file_id'), not {' and '.join(repr(g) for g in given)}")
        if "file_id" in raw and not isinstance(raw["file_id"], str):
            return "field 'file_id' must be a string (the id POST /v1/files answered)"
        if "content" in raw or "file_id" in raw:
            if "content" in raw and not isinstance(raw["content"], str):
                return "field 'content' must be a string (the file, base64)"
            media_type = raw.get("media_type")
            if media_type is not None and (not isinstance(media_type, str) or len(media_type) > 200
                                           or "\x00" in media_type):
                return "field 'media_type' must be a string of at most 200 characters (e.g. application/pdf)"
            return None
        if "media_type" in raw:
            return "field 'media_type' goes with 'content' or 'file_id' (a file), not with 'document' (text)"
        if not isinstance(raw.get("document"), str):
            return ("field 'document' (text), 'content' (a file, base64) or 'file_id' (an uploaded file) is "
                    "required; 'document' must be a string")
        if "\x00" in raw["document"]:
            return "field 'document' contains U+0000, which cannot be stored"
        return self._size_problem(raw["document"])

    def _size_problem(self, text: str) -> str | None:
        size, limit = len(text.encode("utf-8", "surrogatepass")), self.settings.max_document_bytes
        if size > limit:
            return f"document is {size} bytes; the limit is {limit} bytes (max_document_bytes)"
        return None

    def _read_entries(self, checked: list[tuple[int, Any, str | None]]
                      ) -> list[tuple[int, Any, str | None, Submitted | None]]:
        """(line, entry, problem, document) per entry: files ('content') are checked here
        (services/content.py: size, type, that they open, pages) and read by a worker; uploaded
        files ('file_id') must be this tenant's documents. A file that fails a check is a problem."""
        from structspec.ingest import IngestError

        limits, out = self.limits, []
        missing = self.file_problems([raw["file_id"] for _, raw, problem in checked if not problem and "file_id" in raw])
        for n, raw, problem in checked:
            if problem:
                out.append((n, raw, problem, None))
            elif "file_id" in raw:
                problem = missing.get(raw["file_id"])
                out.append((n, raw, f"file_id: {problem}" if problem else None,
                            Submitted(file_id=raw["file_id"], media_type=raw.get("media_type"))))
            elif "content" not in raw:
                out.append((n, raw, None, Submitted(text=raw["document"])))
            else:
                try:
                    doc = submitted_file(decode_base64(raw["content"]), raw.get("media_type"), limits)
                except IngestError as e:
                    out.append((n, raw, f"content: {e}", None))
                    continue
                out.append((n, raw, None if doc.to_read else self._size_problem(doc.text), doc))
        return out

    def get_batch(self, batch_id: str) -> BatchRead:
        with self.session_factory() as session:
            batch = self._batch(session, batch_id)
            counts, latest = JobRepository(session).counts(batch.id)
            return to_batch_read(batch, counts, latest)

    def _batch_and_pending(self, batch_id: str) -> tuple[BatchRead, uuid.UUID | None]:
        """The batch as get_batch reads it, and one of its unfinished jobs (None: none left).
        The two reads are separate snapshots (SQLite without BEGIN, PostgreSQL's read committed),
        so the unfinished job is read first: a job that ends between them then shows in the
        counts, whereas counts read first could be older than a None and answer "unfinished"
        for a batch that has ended."""
        with self.session_factory() as session:
            batch = self._batch(session, batch_id)
            repo = JobRepository(session)
            pending = repo.one_unfinished(batch.id)
            counts, latest = repo.counts(batch.id)
            return to_batch_read(batch, counts, latest), pending

    async def wait_batch(self, waiter: JobWaiter, batch_id: str, seconds: float) -> BatchRead:
        """The batch once finished, or as it is after `seconds`. The wait holds no thread: it
        sleeps on one unfinished job at a time (api/services/waiting.py) and reads the batch
        again when that job ends, so it wakes at most once per job."""
        deadline = time.monotonic() + seconds
        while True:
            batch, pending = await anyio.to_thread.run_sync(self._batch_and_pending, batch_id)
            if batch.finished_at is not None or pending is None or time.monotonic() >= deadline:
                return batch
            try:
                async with contextlib.aclosing(waiter.changes(pending, lambda: self.record(pending),
                                                              deadline)) as changes:
                    async for job in changes:
                        if job.status in TERMINAL_STATUSES:
                            break
            except NotFoundError:  # that job was deleted meanwhile: read the batch again (a 404 if it went too)
                pass

    def list_batches(self, *, limit: int, offset: int, schema_id: uuid.UUID | None = None) -> BatchPage:
        """The tenant's batches, newest first, with their counts and status."""
        with self.session_factory() as session:
            page, total = BatchRepository(session).page(self.tenant, limit=limit, offset=offset, schema_id=schema_id)
            counts = JobRepository(session).counts_of([b.id for b in page])
            items = [to_batch_read(b, *counts[b.id]) for b in page]
        return BatchPage(items=items, total=total, limit=limit, offset=offset)

    def cancel_batch(self, batch_id: str) -> BatchRead:
        with self.session_factory.begin() as session:
            batch = self._batch(session, batch_id)
            cancelled = JobRepository(session).cancel_unfinished_in_batch(batch.id)
            log.info("batch cancelled", extra={"batch_id": str(batch.id), "schema_id": str(batch.schema_id),
                                               "cancelled_jobs": cancelled})
            if batch.cancelled_at is None:
                batch.cancelled_at = utcnow()
        return self.get_batch(batch_id)

    def delete_batch(self, batch_id: str) -> None:
        """Delete a batch and all its jobs, documents and results; unfinished ones stop as by a
        cancel. 409 for the batch behind an OpenAI-format batch (its object counts from them)."""
        with self.session_factory.begin() as session:
            batch = self._batch(session, batch_id)
            repo = BatchRepository(session)
            owner = repo.openai_batch_of(batch.id)
            if owner is not None:
                raise ApiError(409, f"batch {batch.id} runs the OpenAI-format batch {owner}, which reads its "
                                    "requests from it; it cannot be deleted here",
                               [ErrorItem(path="id", message=f"behind {owner}", source="path")])
            counts, _ = JobRepository(session).counts(batch.id)
            repo.delete(batch.id)
            log.info("batch deleted", extra={"batch_id": str(batch.id), "schema_id": str(batch.schema_id),
                                             "jobs": sum(counts.values()),
                                             "unfinished": counts["queued"] + counts["running"]})

    def batch_results(self, batch_id: str) -> Iterator[bytes]:
        """NDJSON lines `{id, status, result | error, stats}` in input order (checked eagerly:
        an unknown batch is a 404 before streaming starts)."""
        with self.session_factory() as session:
            bid = self._batch(session, batch_id).id
        return self._result_lines(bid)

    def _result_lines(self, batch_id: uuid.UUID) -> Iterator[bytes]:
        after = -1
        while True:
            with self.session_factory() as session:
                page = JobRepository(session).batch_page(batch_id, after, RESULTS_PAGE)
                lines = [result_line(j) for j in page]
            if not page:
                return
            after = page[-1].position
            yield b"".join(lines)

    # --- shared --------------------------------------------------------------------------------

    def request_options(self, given: JobOptions | None) -> RequestOptions:
        """`given` with the server's defaults filled in (strategy: job_strategy), checked: a bad
        option is a 422 naming it. Under auto an unset draft_len stays unset (the worker picks k)."""
        values = msgspec.structs.asdict(given) if given else {}
        if values.get("strategy") is None:
            values["strategy"] = self.settings.job_strategy
        try:
            return RequestOptions.from_dict(values).with_defaults(self.settings).check()
        except OptionError as e:
            raise UnprocessableError(f"invalid option: {e}", [
                ErrorItem(path=f"/options/{e.option}", message=str(e), source="body")]) from None

    def submit_chat(self, schema: dict[str, Any], messages: list[dict[str, str]], options: RequestOptions,
                    registered_by: str, stream: bool = False, files: ChatFiles | None = None) -> uuid.UUID:
        """One job prompted with chat `messages` ({role, content}) through the model's chat
        template (the OpenAI-compatible surface); their text is the job's document, which the
        n-gram proposers draft from. The schema is registered, or reused, by its content.
        `stream`: the worker writes the output text while it runs (jobs.partial). `files`: file
        parts a worker reads first (their text then goes into `messages`, worker/ingest.py)."""
        from structspec.engine.prompt import messages_text

        document: str | ChatFiles = files if files is not None else messages_text(messages)
        if files is None:  # before the schema is registered: a refusal stores nothing
            self.check_document(document, "/messages")
        schema_id = self.resolve_schema(None, schema, registered_by)
        answer, _ = self._queue_one(schema_id, document, options, messages, stream)
        return uuid.UUID(answer["id"])

    def record(self, job_id: uuid.UUID) -> JobRecord:
        """The job's row as it is now."""
        with self.session_factory() as session:
            return self._job(session, str(job_id))

    async def wait_finished(self, waiter: JobWaiter, job_id: uuid.UUID, seconds: float) -> JobRecord:
        """The job's row once finished, or as it is after `seconds`; the wait holds no thread
        (api/services/waiting.py)."""
        job = None
        async with contextlib.aclosing(waiter.changes(job_id, lambda: self.record(job_id),
                                                      time.monotonic() + seconds)) as changes:
            async for job in changes:
                if job.status in TERMINAL_STATUSES:
                    break
        return job

    def cancel_quietly(self, job_id: uuid.UUID) -> None:
        """Cancel a job nobody waits for any more (a streamed reply whose client went away);
        a finished one stays as it is."""
        try:
            with self.session_factory.begin() as session:
                if JobRepository(session).cancel(job_id):
                    log.info("job cancelled: its streaming client went away", extra={"job_id": str(job_id)})
        except Exception as e:  # the reply is gone either way; the job then just runs to its end
            log.warning("could not cancel job %s after its client went away: %s", job_id, preview(e))

    def resolve_schema(self, schema_id: str | None, inline: dict[str, Any] | None,
                       registered_by: str = "POST /v1/extractions") -> uuid.UUID:
        """The id of a registered schema (this tenant's), or of `inline` registered now; 422/404
        naming the problem. Used by the OpenAI surface too."""
        if (schema_id is None) == (inline is None):
            raise UnprocessableError("give exactly one of schema_id and schema", [
                ErrorItem(path="/schema_id", message="exactly one of schema_id and schema is required",
                          source="body")])
        registry = SchemaRegistry(self.session_factory, self.settings, self.tenant)
        try:
            if inline is not None:
                from structspec.grammar import schema_hash

                stored, _ = registry.register("inline-" + schema_hash(inline)[:16], inline,
                                              f"registered inline by {registered_by}")
                return stored.id
            return registry.get(schema_id).id
        except RegistryError as e:  # an ApiError here: the OpenAI batch check collects them per line
            raise from_registry(e) from None

    def schema_body(self, schema_id: str | None, inline: dict[str, Any] | None) -> dict[str, Any]:
        """The body of a registered schema (404 when unknown), or `inline` once it passed every
        registration check (422 naming the problem), registering nothing."""
        if (schema_id is None) == (inline is None):
            return self.resolve_schema(schema_id, inline)  # raises the 422 naming both fields
        registry = SchemaRegistry(self.session_factory, self.settings, self.tenant)
        try:
            if inline is not None:
                registry.check(inline)
                return inline
            return registry.get(schema_id).schema
        except RegistryError as e:
            raise from_registry(e) from None

    def _token_problems(self, schema: dict[str, Any], documents: list[str],
                        options: RequestOptions) -> list[str | None]:
        """Per document, why its prompt with `schema` cannot fit the model's context (None: it
        fits, the API has no tokenizer and leaves the check to the worker, or the options ask
        for chunking, which the worker does where a document does not fit)."""
        if options.chunking == "auto" or self.doclen is None or not documents or self.doclen.counter() is None:
            return [None] * len(documents)
        return self.doclen.problems(schema, documents)

    def check_document(self, document: str, path: str) -> None:
        """413 naming `path` when the document is over max_document_bytes."""
        size, limit = len(document.encode("utf-8", "surrogatepass")), self.settings.max_document_bytes
        if size > limit:
            raise PayloadTooLargeError(
                f"document is {size} bytes; the limit is {limit} bytes (max_document_bytes)",
                [ErrorItem(path=path, message=f"{size} bytes > {limit} bytes", source="body")])

    def publish(self, ids: list[uuid.UUID], rows: list[dict[str, Any]], undo, what: dict[str, Any]) -> None:
        """Send the stored jobs `ids` (their `rows` as stored, in the same order) to the broker: to
        the ingest queue those whose file is to be read first (phase "reading"), the others to the
        model's queue; if that fails, run `undo` (it deletes what was stored) and answer 503, so that
        nothing is left queued that no worker will see."""
        from structspec.worker.app import enqueue, enqueue_reads

        reads = [i for i, row in zip(ids, rows, strict=True) if row.get("phase") == "reading"]
        ids = [i for i, row in zip(ids, rows) if row.get("phase") != "reading"]
        try:
            if reads:
                enqueue_reads(self.publisher, reads)
            if ids:
                enqueue(self.publisher, ids)
        except Exception as e:  # kombu/redis/amqp connection errors differ per transport
            log.warning("broker unavailable at submit: %s", preview(e, 300),
                        extra={**{k: str(v) for k, v in what.items()}, "jobs": len(ids)})
            with self.session_factory.begin() as session:
                undo(session)
            msg = " ".join(str(e).split())[:300] or type(e).__name__
            raise ApiError(503, "the job queue (broker) is unavailable; nothing was stored, retry later",
                           [ErrorItem(message=msg, source="broker")], headers={"retry-after": "5"}) from None

    def _job(self, session: Session, job_id: str) -> JobRecord:
        return _get_or_404(JobRepository(session), job_id, "extraction job", self.tenant)

    def _batch(self, session: Session, batch_id: str) -> BatchRecord:
        return _get_or_404(BatchRepository(session), batch_id, "batch", self.tenant)


STATS_KEYS = tuple(JobStats.__struct_fields__)


def job_fields(j: JobRecord, **more: Any) -> dict[str, Any]:
    """A job's ids as log fields (never its document or result)."""
    out = {"job_id": str(j.id), "schema_id": str(j.schema_id)}
    if j.batch_id is not None:
        out["batch_id"] = str(j.batch_id)
    return {**out, **more}


def to_job_read(j: JobRecord) -> JobRead:
    return JobRead(id=j.id, status=j.status, phase=j.phase, warnings=j.warnings, schema_id=j.schema_id,
                   batch_id=j.batch_id,
                   result=j.result if j.status == "succeeded" else None, error=j.error,
                   stats=JobStats(**{k: j.stats.get(k) for k in STATS_KEYS}) if j.stats else None,
                   timings=JobTimings(queued_s=j.queued_s, prefill_s=j.prefill_s, decode_s=j.decode_s),
                   created_at=j.created_at, finished_at=j.finished_at, **grounding(j), boxes=boxes(j))


def boxes(j: JobRecord) -> dict[str, list[PageBox]] | None:
    """A succeeded job's spans on the pages of the PDF or image it was sent as (structspec.ingest), else None."""
    if j.status != "succeeded" or j.layout is None or not j.spans:
        return None
    from structspec.ingest import decode_layout

    located = decode_layout(j.document, j.layout).locate_spans(j.spans)
    return {ptr: [PageBox(page=b["page"], box=b["box"]) for b in places] for ptr, places in located.items()}


def grounding(j: JobRecord) -> dict[str, Any]:
    """A succeeded job's spans and confidence (engine/grounding.py), None otherwise."""
    if j.status != "succeeded":
        return {"spans": None, "confidence": None}
    return {"spans": j.spans, "confidence": j.confidence}


def result_line(j: JobRecord) -> bytes:
    line: dict[str, Any] = {"id": msgspec.json.decode(j.doc_id) if j.doc_id else j.position,
                            "status": j.status}
    if j.status == "succeeded":
        line["result"] = j.result
        line.update(grounding(j))
        line["boxes"] = msgspec.to_builtins(boxes(j))  # a file's values on its pages (null: text), as a job read
        line["warnings"] = j.warnings
    else:
        line["error"] = j.error
    line["stats"] = {k: j.stats.get(k) for k in STATS_KEYS} if j.stats else None
    return msgspec.json.encode(line) + b"\n"


def _get_or_404(repository, record_id: str, what: str, tenant: str):
    """The record with id `record_id` (a UUID string) of `tenant`, or NotFoundError naming it
    (another tenant's record is answered exactly like an unknown id)."""
    try:
        record = repository.get(uuid.UUID(record_id))
    except ValueError:
        record = None
    if record is None or record.tenant != tenant:
        raise NotFoundError(f"no {what} with id {record_id}")
    return record
