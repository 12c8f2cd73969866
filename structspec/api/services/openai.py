"""The OpenAI-compatible surface below HTTP: reading a chat request, building the
chat.completion of a finished job, the streamed chunks of a running one, and Files and
Batches in OpenAI's Batch format (the routes are in structspec/api/openai.py).

A batch is validated within the create request: lines that cannot be keyed (not a JSON object,
no custom_id, a repeated custom_id) fail the whole batch with `errors`; a keyed line that is
not a valid request goes to the error file; every valid one becomes a job of a structspec
batch with no schema (jobs.position: its order among the valid lines, jobs.doc_id: its
custom_id). Status, counts and the output and error files are settled when the batch is read
(`refresh`): the first read after its last job ended writes the files.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, AsyncIterator, Callable, Iterator

import anyio
import msgspec

from structspec.api.errors import ApiError, ErrorItem, NotFoundError
from structspec.api.guard import check_body
from structspec.api.services.content import ChatFiles, Submitted, data_url, submitted_file
from structspec.api.services.files import FileService
from structspec.api.services.jobs import DOC_ID_CHARS, Idempotency, JobService, grounding
from structspec.api.services.waiting import JobWaiter
from structspec.api.structs import JobOptions
from structspec.api.uploads import Upload
from structspec.db.columns import database_now
from structspec.db.jobs import BatchRepository, JobRepository
from structspec.db.models import TERMINAL_STATUSES, JobRecord, OpenAIBatchRecord
from structspec.db.files import DOCUMENT_PURPOSE, FileRepository
from structspec.db.openai_batches import OpenAIBatchRepository
from structspec.engine.prompt import MessagesError, chat_messages as checked_messages, messages_text
from structspec.ingest import IngestError, Limits
from structspec.options import RequestOptions

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
# structspec's own request parameters, in a body field of their own (the reply's extension field has
# the same name): in a batch line's body too, where headers cannot go
EXTENSION = "structspec"
EXTENSION_OPTIONS = ("timeout_s",)
CHAT_ENDPOINT = "/v1/chat/completions"
KNOWN_FIELDS = {"model", "messages", "response_format", "max_tokens", "max_completion_tokens", "temperature",
                "seed", "n", "stream", "stream_options", "user", "metadata", "store", EXTENSION}
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
METADATA_LIMITS = (16, 64, 512)  # pairs, key characters, value characters (OpenAI's)


def served_model(model_setting: str) -> str:
    return DEFAULT_MODEL_ID if model_setting in ("default", "") else model_setting


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, [ErrorItem(path=param or "", message=message, source="body")])


# --- one chat request -------------------------------------------------------------------------

def chat_messages(raw: Any) -> list[dict[str, str]]:
    try:
        return checked_messages(raw)
    except MessagesError as e:
        raise bad_request(str(e), e.param) from None


# --- files in messages --------------------------------------------------------------------------

FILE_PART_TYPES = ("file", "image_url")
PURPOSES = ("batch", DOCUMENT_PURPOSE)
BLANK_LINE = {"type": "text", "text": "\n\n"}  # between a file's text and the parts beside it


def file_parts(raw: Any, files: Callable[[str], Any], limits: Limits) -> tuple[Any, ChatFiles | None]:
    """`raw` messages with each file content part replaced by a text part, set apart from the
    text parts beside it by a blank line, and the files left to read. A file part is OpenAI's
    `{"type": "file", "file": {"file_data": "data:<media type>;base64,...", "filename"?} |
    {"file_id": ...}}` or `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`;
    `files(file_id)` gives an uploaded file's record. A text file's text is put in place now; any
    other file is checked (services/content.py: submitted_file) and its text part left empty for
    the worker that reads it (worker/ingest.py). Anything else is left for chat_messages to judge."""
    if not isinstance(raw, list):
        return raw, None
    out, deferred = [], []
    for i, message in enumerate(raw):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_file_part(p) for p in content):
            out.append(message)
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            if not _is_file_part(part):
                parts.append(part)
                continue
            where = f"messages.{i}.content.{j}"
            try:
                file = _file_of(part, where, files, limits)
            except IngestError as e:
                raise ApiError(e.status, f"{where}: {e}", [ErrorItem(path=where, message=str(e), source="body")]) \
                    from None
            if parts and parts[-1] != BLANK_LINE:
                parts.append(BLANK_LINE)
            if file.to_read:
                deferred.append(((i, len(parts)), file))
            parts += [{"type": "text", "text": file.text or ""}, BLANK_LINE]
        if parts and parts[-1] == BLANK_LINE:
            parts.pop()
        out.append({**message, "content": parts})
    return out, ChatFiles(tuple(deferred)) if deferred else None


def _is_file_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in FILE_PART_TYPES


def _file_of(part: dict[str, Any], where: str, files: Callable[[str], Any], limits: Limits) -> Submitted:
    """The file of a file content part, checked (its text, if it is text); ApiError 400 for a
    malformed part, IngestError for a file that fails the checks."""
    if part["type"] == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else None
        if not isinstance(url, str):
            raise bad_request(f"{where}: image_url.url is required (a data: URL)", f"{where}.image_url.url")
        return submitted_file(*data_url(url), limits)
    spec = part.get("file")
    if not isinstance(spec, dict) or ("file_data" in spec) == ("file_id" in spec):
        raise bad_request(f"{where}: file needs file_data (a data: URL) or file_id, one of them", f"{where}.file")
    name = spec.get("filename") if isinstance(spec.get("filename"), str) else None
    if "file_data" in spec:
        if not isinstance(spec["file_data"], str):
            raise bad_request(f"{where}: file.file_data must be a string (a data: URL)", f"{where}.file.file_data")
        return submitted_file(*data_url(spec["file_data"]), limits, name)
    record = files(spec["file_id"]) if isinstance(spec["file_id"], str) else None
    if record is None:
        raise bad_request(f"{where}: no file with id {spec['file_id']}", f"{where}.file.file_id")
    if record.purpose != DOCUMENT_PURPOSE:
        raise bad_request(f"{where}: file {record.id} has purpose {record.purpose!r}; a file read as a document is "
                          f"uploaded with purpose {DOCUMENT_PURPOSE}", f"{where}.file.file_id")
    return Submitted(file_id=record.id, media_type=record.media_type, name=name or record.filename)


def response_schema(raw: Any) -> dict[str, Any]:
    """The JSON Schema a response_format asks for ({"type": "object"} for json_object)."""
    if raw is None:
        raise bad_request("response_format is required: this service answers with JSON only; use "
                          '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} or '
                          '{"type": "json_object"}', "response_format")
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = raw.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request("response_format.json_schema.schema must be a JSON Schema object",
                              "response_format.json_schema.schema")
        return spec["schema"]
    raise bad_request(f"response_format type {kind!r} is not supported: use json_schema or json_object",
                      "response_format.type")


def job_options(body: dict[str, Any]) -> JobOptions:
    """Decoding options from the request. temperature defaults to 0 (greedy) here, not 1. The
    extension field `structspec` may hold timeout_s."""
    extension = body.get(EXTENSION)
    if extension is not None and (not isinstance(extension, dict) or set(extension) - set(EXTENSION_OPTIONS)):
        raise bad_request(f"{EXTENSION} must be an object holding only {', '.join(EXTENSION_OPTIONS)}", EXTENSION)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    values = {"temperature": body.get("temperature"), "seed": body.get("seed"), "max_tokens": max_tokens,
              f"{EXTENSION}.timeout_s": (extension or {}).get("timeout_s")}
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad_request(f"{name} must be a number", name)
    return JobOptions(temperature=values["temperature"], seed=values["seed"], max_tokens=max_tokens,
                      timeout_s=values[f"{EXTENSION}.timeout_s"])


def check_request(body: Any, streaming: bool = True) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise bad_request(f"unsupported parameter {unknown[0]!r}", unknown[0])
    if body.get("n", 1) != 1:
        raise bad_request("n must be 1", "n")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad_request(f"stream must be true or false (a JSON boolean), not {body['stream']!r}", "stream")
    if body.get("stream") and not streaming:
        raise bad_request("stream is not supported in a batch request", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad_request("stream_options may only hold include_usage", "stream_options")
    if options is not None and options.get("include_usage") is not None \
            and not isinstance(options["include_usage"], bool):
        raise bad_request("stream_options.include_usage must be true or false (a JSON boolean)", "stream_options")
    return body


def uploaded_file(jobs: JobService, file_id: str):
    """The tenant's uploaded file `file_id` (its record), or None."""
    with jobs.session_factory() as session:
        record = FileRepository(session, jobs.tenant).get(file_id)
        if record is not None:
            session.expunge(record)
        return record


class ChatRequest(msgspec.Struct, kw_only=True):
    """A checked chat request, ready to queue."""

    messages: list[dict[str, str]]
    schema: dict[str, Any]
    options: RequestOptions
    stream: bool = False
    include_usage: bool = False
    files: ChatFiles | None = None  # file parts a worker reads before the model runs

    def columns(self) -> dict[str, Any]:
        """The job row's document columns: the messages' text, or (files to read) those files'."""
        if self.files is None:
            return {"document": messages_text(self.messages)}
        return self.files.columns()


def read_chat_request(body: Any, jobs: JobService, streaming: bool = True) -> ChatRequest:
    """Every check of a chat request (ApiError naming the parameter), options resolved; its
    file parts checked and left for a worker to read (file_parts)."""
    body = check_request(body, streaming)
    raw, files = file_parts(body.get("messages"), lambda file_id: uploaded_file(jobs, file_id), jobs.limits)
    messages = chat_messages(raw)
    if files is not None:  # kept as content parts, checked: the reader puts each file's text in its part
        messages = raw
    schema = response_schema(body.get("response_format"))
    options = jobs.request_options(job_options(body))
    return ChatRequest(messages=messages, schema=schema, options=options, stream=bool(body.get("stream")),
                       include_usage=bool((body.get("stream_options") or {}).get("include_usage")), files=files)


# --- the answer -------------------------------------------------------------------------------

def content_of(job: JobRecord) -> str | None:
    """The generated text: as the model wrote it when the worker kept it (chat jobs), else the
    result serialised compactly; None for a job with no output."""
    if job.partial is not None:
        return "".join(job.partial)
    if job.status == "succeeded":
        return json.dumps(job.result, ensure_ascii=False, separators=(",", ":"))
    return None


def finish_reason(job: JobRecord) -> str:
    """stop, or length for a job cut at max_tokens or the context; ApiError for a job that
    failed otherwise (its error, 400 for a document too long, else 500)."""
    if job.status == "succeeded":
        return "stop"
    if job.status == "failed" and (job.error or "").startswith("truncated:"):
        return "length"
    if (job.error or "").startswith("document too long"):
        raise bad_request(job.error, "messages")
    raise ApiError(500, f"the extraction failed: {job.error}")


def usage(job: JobRecord) -> dict[str, int]:
    stats = job.stats or {}
    prompt, output = stats.get("prompt_tokens", 0), stats.get("output_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


def extension(job: JobRecord) -> dict[str, Any]:
    """The `structspec` field: the job and its speculation stats."""
    stats = job.stats or {}
    return {"job_id": str(job.id), "schema_id": str(job.schema_id),
            **{k: stats.get(k) for k in ("strategy", "draft_len", "target_passes", "tokens_per_pass",
                                         "acceptance_rate")}, **grounding(job)}


def completion(job: JobRecord, model: str) -> dict[str, Any]:
    """The chat.completion of a finished job, or an ApiError for one that failed."""
    finish = finish_reason(job)
    return {
        "id": f"chatcmpl-{job.id.hex}", "object": "chat.completion", "created": int(job.created_at.timestamp()),
        "model": model,
        "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                     "message": {"role": "assistant", "content": content_of(job), "refusal": None}}],
        "usage": usage(job), "structspec": extension(job),
    }


async def stream_chunks(jobs: JobService, waiter: JobWaiter, job_id: uuid.UUID, model: str, timeout_s: float,
                        include_usage: bool) -> AsyncIterator[dict[str, Any]]:
    """chat.completion.chunk objects for a queued streamed job, as its text is written: one
    chunk per piece the worker stored (a piece holds the text of one target pass, several
    tokens when a draft was accepted), then one with the finish_reason (and one with usage
    when asked). It waits on `waiter` between pieces, holding no thread. A failure mid-way
    ends with {"error": ...}, as OpenAI's stream does. Closed before the end (the client went
    away), it cancels the job."""
    sent, created = 0, int(time.time())
    base = {"id": f"chatcmpl-{job_id.hex}", "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> dict[str, Any]:
        return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                **more}

    finished = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        async with contextlib.aclosing(waiter.changes(job_id, lambda: jobs.record(job_id),
                                                      time.monotonic() + timeout_s)) as changes:
            async for job in changes:
                new = (job.partial or [])[sent:]
                for piece in new:
                    yield chunk({"content": piece})
                sent += len(new)
                if job.status in TERMINAL_STATUSES:
                    finished = True
                    try:
                        finish = finish_reason(job)
                    except ApiError as e:
                        yield {"error": error_object(e.status_code, e.detail)}
                        return
                    yield chunk({}, finish, structspec=extension(job))
                    if include_usage:
                        yield {**base, "choices": [], "usage": usage(job)}
                    return
        finished = True
        yield {"error": error_object(504, f"the extraction did not finish within {timeout_s:g} s "
                                          f"(STRUCTSPEC_CHAT_TIMEOUT_S); job {job_id} goes on: "
                                          f"GET /v1/extractions/{job_id}")}
    finally:
        if not finished:  # the client went away: nobody will read this job
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(jobs.cancel_quietly, job_id)


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error"}


def error_object(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}


def flatten(detail: str, errors: list[ErrorItem]) -> tuple[str, str | None, str | None]:
    """structspec's error (detail and itemised problems) as OpenAI's one message, the parameter
    it names (dotted; options are top-level parameters there) and its code."""
    item = errors[0] if errors else None
    if item is None:
        return detail, None, None
    message = f"{detail}: {item.message}" if item.message and item.message not in detail else detail
    param = item.path.strip("/").replace("/", ".") or None
    if param and param.startswith("options."):
        param = param.removeprefix("options.")
    return message, param, item.keyword


# --- Files and Batches ------------------------------------------------------------------------

def file_object(record) -> dict[str, Any]:
    return {"id": record.id, "object": "file", "bytes": record.bytes, "created_at": int(record.created_at.timestamp()),
            "filename": record.filename, "purpose": record.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def listing(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page (the SDKs follow `after=last_id` while has_more)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _ts(value) -> int | None:
    return None if value is None else int(value.timestamp())


@dataclass
class BatchLineError:
    """A batch input problem: `code`, message, and the 1-based line it is on."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_lines(content: bytes, limit: int) -> tuple[list[tuple[int, str, dict[str, Any]]], list[BatchLineError]]:
    """(line number, custom_id, request) per non-empty line, and the problems that cannot be
    keyed by a custom_id (any: the batch fails at validation)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [BatchLineError("invalid_file_format", f"the file is not UTF-8: {e}")]
    out, problems, seen = [], [], {}
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError as e:
            problems.append(BatchLineError("invalid_json_line", f"line {n} is not JSON: {e}", n))
            continue
        custom_id = request.get("custom_id") if isinstance(request, dict) else None
        if not isinstance(request, dict):
            problems.append(BatchLineError("invalid_json_line", f"line {n} is not a JSON object", n))
        elif not isinstance(custom_id, str) or not custom_id or len(custom_id) > 180 \
                or len(json.dumps(custom_id, ensure_ascii=False)) > DOC_ID_CHARS:
            problems.append(BatchLineError("missing_custom_id", f"line {n}: custom_id must be a non-empty "
                                                                "string of at most 180 characters", n, "custom_id"))
        elif custom_id in seen:
            problems.append(BatchLineError("duplicate_custom_id", f"line {n}: custom_id {custom_id!r} is already "
                                                                  f"used on line {seen[custom_id]}", n, "custom_id"))
        else:
            seen[custom_id] = n
            out.append((n, custom_id, request))
    if not out and not problems:
        problems.append(BatchLineError("empty_file", "the input file holds no request"))
    if len(out) + len(problems) > limit:
        problems.insert(0, BatchLineError("too_many_requests", f"the file holds {len(out) + len(problems)} "
                                                               f"requests; the limit is {limit} (max_batch_size)"))
    return out, problems[:100]


class OpenAIBatchService:
    """Files and OpenAI-format batches of one tenant (another tenant's ids read as unknown)."""

    def __init__(self, jobs: JobService):
        self.jobs = jobs
        self.session_factory, self.settings, self.tenant = jobs.session_factory, jobs.settings, jobs.tenant
        self.model = served_model(self.settings.model)

    # --- files ---------------------------------------------------------------------------------

    def upload(self, upload: Upload, purpose: str) -> dict[str, Any]:
        """Store an uploaded file (spooled by api/uploads.py) in the one file store; a user_data
        file must be of a kind structspec.ingest reads (its first bytes, else the media type the
        upload labels it with, else its name's extension); a batch input is JSONL text (no NUL)."""
        if purpose not in PURPOSES:
            raise bad_request(f"purpose {purpose!r} is not served: files here are batch inputs (purpose batch) or "
                              f"documents named by a message's file part (purpose {DOCUMENT_PURPOSE})", "purpose")
        if upload.size == 0 or (upload.size < 4096 and not upload.file.read().strip()):
            raise bad_request("the file is empty", "file")
        upload.file.seek(0)
        files = FileService(self.session_factory, self.settings, self.tenant)
        kind = None
        if purpose == DOCUMENT_PURPOSE:
            try:
                kind = files.check_document(upload)
            except ApiError as e:
                raise bad_request(f"{upload.filename or 'the file'}: {e.detail}", "file") from None
        else:  # JSONL read whole at batch creation anyway; NUL is refused here, as in any JSON body
            check_body(upload.file.read(), ndjson=True)
            upload.file.seek(0)
        return file_object(files.store(upload, purpose, kind))

    def file(self, file_id: str) -> dict[str, Any]:
        with self.session_factory() as session:
            return file_object(self._file(session, file_id))

    def file_content(self, file_id: str) -> bytes:
        with self.session_factory() as session:
            return FileRepository(session, self.tenant).content(self._file(session, file_id).id)

    def files(self, purpose: str | None, after: str | None, limit: int) -> dict[str, Any]:
        if not 1 <= limit <= 10_000:
            raise bad_request("limit must be between 1 and 10000", "limit")
        with self.session_factory() as session:
            page = FileRepository(session, self.tenant).page(purpose, after, limit + 1)
            return listing([file_object(f) for f in page[:limit]], len(page) > limit)

    def delete_file(self, file_id: str) -> dict[str, Any]:
        with self.session_factory.begin() as session:
            if not FileRepository(session, self.tenant).delete(file_id):
                raise NotFoundError(f"no file with id {file_id}")
        return {"id": file_id, "object": "file", "deleted": True}

    def _file(self, session, file_id: str):
        record = FileRepository(session, self.tenant).get(file_id)
        if record is None:
            raise NotFoundError(f"no file with id {file_id}")
        return record

    # --- batches -------------------------------------------------------------------------------

    def create(self, body: Any, idem: Idempotency | None = None) -> tuple[dict[str, Any], bool]:
        """The new batch's object, and whether it answers a repeat of an earlier create with the
        same Idempotency-Key (then it is that batch as it is now, and nothing new runs)."""
        if (first := self.jobs.replay(idem)) is not None:
            return self.get(first["id"]), True
        input_file_id, endpoint, window, metadata = self._check_create(body)
        with self.session_factory() as session:
            source = self._file(session, input_file_id)
            if source.purpose != "batch":
                raise bad_request(f"file {input_file_id} has purpose {source.purpose!r}, not batch", "input_file_id")
            content = FileRepository(session, self.tenant).content(source.id)
        fields = dict(input_file_id=input_file_id, endpoint=endpoint, completion_window=window, metadata_=metadata)
        lines, problems = read_lines(content, self.settings.max_batch_size)
        if problems:
            def failed(session) -> dict[str, Any]:
                return {"id": OpenAIBatchRepository(session, self.tenant).add(
                    **fields, status="failed", total=0, invalid=[], failed_at=database_now(session),
                    errors=[p.as_dict() for p in problems]).id}

            answer, replayed = self.jobs.store_once(idem, failed)
            return self.get(answer["id"]), replayed
        rows, invalid = self._jobs_of(lines, endpoint)
        stored: dict[str, Any] = {}

        def write(session) -> dict[str, Any]:
            now = database_now(session)
            stored["batch_id"] = None
            if rows:
                batch = BatchRepository(session).add(tenant=self.tenant, schema_id=None, total=len(rows), options={})
                stored["batch_id"] = batch.id
                for row in rows:
                    row["batch_id"] = batch.id
                stored["ids"] = JobRepository(session).add_many(rows)
            record = OpenAIBatchRepository(session, self.tenant).add(
                **fields, status="in_progress", batch_id=stored["batch_id"], total=len(lines), invalid=invalid,
                in_progress_at=now, expires_at=now + COMPLETION_WINDOWS[window])
            return {"id": record.id}

        answer, replayed = self.jobs.store_once(idem, write)
        record_id, batch_id = answer["id"], stored.get("batch_id")
        if rows and not replayed:
            self.jobs.publish(stored["ids"], rows,
                              undo=lambda s: (_delete(s, record_id, batch_id), self.jobs.forget(s, idem)),
                              what={"openai_batch_id": record_id, "batch_id": batch_id})
        return self.get(record_id), replayed

    def _check_create(self, body: Any) -> tuple[str, str, str, dict[str, str] | None]:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if unknown:
            raise bad_request(f"unsupported parameter {unknown[0]!r}", unknown[0])
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str):
                raise bad_request(f"{name} is required (a string)", name)
        if body["endpoint"] != CHAT_ENDPOINT:
            raise bad_request(f"endpoint {body['endpoint']!r} is not served: use {CHAT_ENDPOINT}", "endpoint")
        if body["completion_window"] not in COMPLETION_WINDOWS:
            raise bad_request(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}",
                              "completion_window")
        metadata = body.get("metadata")
        pairs, key_len, value_len = METADATA_LIMITS
        if metadata is not None and not (
                isinstance(metadata, dict) and len(metadata) <= pairs
                and all(isinstance(k, str) and isinstance(v, str) and len(k) <= key_len and len(v) <= value_len
                        for k, v in metadata.items())):
            raise bad_request(f"metadata must be at most {pairs} string pairs (keys up to {key_len} characters, "
                              f"values up to {value_len})", "metadata")
        return body["input_file_id"], body["endpoint"], body["completion_window"], metadata

    def _jobs_of(self, lines: list[tuple[int, str, dict[str, Any]]], endpoint: str):
        """(job rows, invalid lines) for the keyed requests."""
        rows, invalid, schemas = [], [], {}
        for n, custom_id, line in lines:
            try:
                unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
                if unknown:
                    raise bad_request(f"unsupported field {unknown[0]!r} in a batch line", unknown[0])
                if line.get("method", "POST") != "POST":
                    raise bad_request("method must be POST", "method")
                if line.get("url") != endpoint:
                    raise bad_request(f"url must be the batch's endpoint {endpoint}", "url")
                request = read_chat_request(line.get("body"), self.jobs, streaming=False)
                key = json.dumps(request.schema, sort_keys=True)
                if key not in schemas:
                    schemas[key] = self.jobs.resolve_schema(None, request.schema, "POST /openai/v1/batches")
                document = request.columns()
                if request.files is None:  # a file's text is checked by the worker that reads it
                    self.jobs.check_document(document["document"], "/body/messages")
            except ApiError as e:
                message, param, _ = flatten(e.detail, e.errors)
                invalid.append({"line": n, "custom_id": custom_id, "status_code": e.status_code, "message": message,
                                "param": param})
                continue
            rows.append(dict(tenant=self.tenant, schema_id=schemas[key], messages=request.messages,
                             options=request.options.as_dict(), position=len(rows),
                             doc_id=json.dumps(custom_id, ensure_ascii=False), **document))
        return rows, invalid

    def get(self, batch_id: str) -> dict[str, Any]:
        with self.session_factory.begin() as session:
            return self._object(session, self._refresh(session, self._batch(session, batch_id, for_update=True)))

    def list(self, after: str | None, limit: int) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise bad_request("limit must be between 1 and 100", "limit")
        with self.session_factory.begin() as session:
            page = OpenAIBatchRepository(session, self.tenant).page(after, limit + 1)
            data = [self._object(session, self._refresh(session, r)) for r in page[:limit]]
        return listing(data, len(page) > limit)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        with self.session_factory.begin() as session:
            record = self._refresh(session, self._batch(session, batch_id, for_update=True))
            if record.status not in ("in_progress", "cancelling"):
                raise ApiError(409, f"batch {batch_id} is {record.status}; only a batch in progress can be cancelled")
            if record.status == "in_progress":
                record.status, record.cancelling_at = "cancelling", database_now(session)
                if record.batch_id is not None:
                    JobRepository(session).cancel_unfinished_in_batch(record.batch_id)
            return self._object(session, record)

    def _batch(self, session, batch_id: str, for_update: bool = False) -> OpenAIBatchRecord:
        record = OpenAIBatchRepository(session, self.tenant).get(batch_id, for_update=for_update)
        if record is None:
            raise NotFoundError(f"no batch with id {batch_id}")
        return record

    def _refresh(self, session, record: OpenAIBatchRecord) -> OpenAIBatchRecord:
        """Settle a batch whose jobs have all ended (the window's end cancels the rest): write
        its output and error files and set its final status."""
        if record.status not in ("in_progress", "cancelling"):
            return record
        repo, now = JobRepository(session), database_now(session)
        unfinished = 0
        if record.batch_id is not None:
            counts, _ = repo.counts(record.batch_id)
            unfinished = counts["queued"] + counts["running"]
            if unfinished and record.status == "in_progress" and now >= record.expires_at:
                repo.cancel_unfinished_in_batch(record.batch_id)
                record.status, unfinished = "expired", 0
        if unfinished:
            return record
        final = {"in_progress": "completed", "cancelling": "cancelled", "expired": "expired"}[record.status]
        # only one reader writes the files (a row lock on PostgreSQL already; SQLite: this)
        if not OpenAIBatchRepository(session, self.tenant).start_finalizing(record.id, record.status, now):
            session.refresh(record)
            return record
        record.finalizing_at = now
        outputs, errors = self._result_lines(session, record, final)
        files = FileRepository(session, self.tenant)
        if outputs:
            record.output_file_id = files.add(purpose="batch_output", filename=f"{record.id}_output.jsonl",
                                              content="".join(outputs).encode()).id
        if errors:
            record.error_file_id = files.add(purpose="batch_output", filename=f"{record.id}_error.jsonl",
                                             content="".join(errors).encode()).id
        record.status = final
        setattr(record, f"{final}_at", now)
        return record

    def _result_lines(self, session, record: OpenAIBatchRecord, final: str) -> tuple[list[str], list[str]]:
        """The output and error files' lines: {id, custom_id, response: {status_code, request_id,
        body}, error}. Requests refused at validation and jobs that failed answer with their
        error's status and body; jobs the cancel or the window's end stopped have no response and
        error.code batch_cancelled / batch_expired."""
        def line(custom_id: str, request_id: str, response: dict | None, error: dict | None) -> str:
            return json.dumps({"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": response,
                               "error": error}, ensure_ascii=False) + "\n"

        outputs, errors = [], []
        for bad in record.invalid:
            errors.append(line(bad["custom_id"], uuid.uuid4().hex, {
                "status_code": bad["status_code"], "request_id": None,
                "body": {"error": error_object(bad["status_code"], bad["message"], bad["param"])}}, None))
        if record.batch_id is None:
            return outputs, errors
        after, repo = -1, JobRepository(session)
        while page := repo.batch_page(record.batch_id, after, 500):
            after = page[-1].position
            for job in page:
                custom_id = json.loads(job.doc_id)
                if job.status == "cancelled" and job.error == "cancelled":
                    code = "batch_expired" if final == "expired" else "batch_cancelled"
                    why = "the batch's completion window ended" if final == "expired" else "the batch was cancelled"
                    errors.append(line(custom_id, job.id.hex, None, {"code": code, "message": f"not run: {why}"}))
                    continue
                try:
                    body = completion(job, self.model)
                except ApiError as e:
                    errors.append(line(custom_id, job.id.hex, {"status_code": e.status_code, "request_id": str(job.id),
                                                               "body": {"error": error_object(e.status_code, e.detail)}},
                                       None))
                    continue
                outputs.append(line(custom_id, job.id.hex, {"status_code": 200, "request_id": str(job.id),
                                                            "body": body}, None))
        return outputs, errors

    def _object(self, session, record: OpenAIBatchRecord) -> dict[str, Any]:
        invalid = len(record.invalid)
        completed = failed = 0
        if record.batch_id is not None:
            counts, _ = JobRepository(session).counts(record.batch_id)
            truncated = JobRepository(session).truncated_in_batch(record.batch_id)
            completed = counts["succeeded"] + truncated
            failed = counts["failed"] - truncated
            if record.status in ("cancelled", "expired"):
                failed += counts["cancelled"]
        errors = None
        if record.errors:
            errors = {"object": "list", "data": record.errors}
        return {
            "id": record.id, "object": "batch", "endpoint": record.endpoint, "errors": errors,
            "input_file_id": record.input_file_id, "completion_window": record.completion_window,
            "status": record.status, "output_file_id": record.output_file_id, "error_file_id": record.error_file_id,
            **{name: _ts(getattr(record, name)) for name in (
                "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
                "expired_at", "cancelling_at", "cancelled_at")},
            "request_counts": {"total": record.total, "completed": completed, "failed": failed + invalid},
            "metadata": record.metadata_,
            "structspec": {"batch_id": str(record.batch_id) if record.batch_id else None},
        }


def _delete(session, record_id: str, batch_id: uuid.UUID) -> None:
    """Undo a batch whose jobs the broker did not take."""
    session.query(OpenAIBatchRecord).filter(OpenAIBatchRecord.id == record_id).delete()
    BatchRepository(session).delete(batch_id)
