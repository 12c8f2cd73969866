"""Request and response bodies (msgspec structs). Create/Read pairs per resource."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, ClassVar

import msgspec
from litestar.openapi.spec import OpenAPIType, Schema

from structspec.api.errors import ErrorItem
from structspec.options import JOB_STRATEGIES, SPECS
from structspec.services.batches import BatchCounts, BatchRead, BatchWebhook  # noqa: F401 - the API's types too

NAME_PATTERN = r"^[A-Za-z0-9._-]*[A-Za-z0-9_-][A-Za-z0-9._-]*$"  # not only dots ("." or "..")
STRATEGIES = list(JOB_STRATEGIES)
# PostgreSQL text cannot hold U+0000, so stored free text refuses it (on every backend alike).
NO_NUL = r"^[^\x00]*$"


def _documented(**keywords: Any) -> dict[str, Any]:
    """JSON Schema keywords for the OpenAPI document only: the service checks these itself
    (RequestOptions.check, 422 naming the option), so msgspec does not enforce them."""
    return {"extra": keywords}


def option_keywords(name: str, nullable: bool = True) -> dict[str, Any]:
    """The JSON Schema bounds and enum of request option `name`, from structspec.options.SPECS
    (`nullable`: the enum also lists null, for a field that may be left unset)."""
    spec = SPECS[name]
    keywords: dict[str, Any] = {k: v for k, v in (("minimum", spec.minimum), ("maximum", spec.maximum))
                                if v is not None}
    if spec.choices is not None:
        keywords["enum"] = [*spec.choices, None] if nullable else list(spec.choices)
    return keywords


def _option(name: str, describe: bool = True, nullable: bool = True) -> msgspec.Meta:
    """A request option's msgspec metadata: SPECS' help as description, its bounds documented only."""
    return msgspec.Meta(description=SPECS[name].help if describe else None,
                        extra_json_schema=_documented(**option_keywords(name, nullable)))


SchemaName = Annotated[str, msgspec.Meta(
    min_length=1, max_length=200, pattern=NAME_PATTERN,
    description="1-200 characters from A-Z a-z 0-9 . _ -, not only dots", examples=["invoice"])]


class SchemaCreate(msgspec.Struct, forbid_unknown_fields=True):
    """Register a JSON Schema under a name; new content under an existing name is a new version."""

    name: SchemaName
    schema: Annotated[dict[str, Any], msgspec.Meta(
        description="a JSON Schema (Draft 2020-12 unless $schema says draft-07 or 2019-09)",
        examples=[{"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}])]
    description: Annotated[str, msgspec.Meta(max_length=10_000, pattern=NO_NUL)] | None = None


class SchemaSummary(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    name: str
    version: int
    hash: Annotated[str, msgspec.Meta(description="sha256 of the schema's canonical JSON")]
    description: str | None
    created_at: datetime
    updated_at: datetime


class SchemaRegistered(SchemaSummary, kw_only=True):
    warnings: Annotated[list[str], msgspec.Meta(
        description="what the grammar does not enforce exactly, as 'path [keyword]: message'; results are "
                    "still validated against the schema, and a job whose output breaks it fails naming the keyword")
    ] = msgspec.field(default_factory=list)


class SchemaDetail(SchemaSummary, kw_only=True):
    schema: dict[str, Any]


class SchemaPage(msgspec.Struct, kw_only=True):
    items: list[SchemaSummary]
    total: int
    limit: int
    offset: int


class HealthReport(msgspec.Struct, kw_only=True):
    status: str  # "ok" | "error"
    database: str  # "ok" | "error: ..."
    broker: str


class HealthFailure(msgspec.Struct, kw_only=True):
    """503: the API's error shape plus the health report."""

    status_code: int
    detail: str
    errors: list[ErrorItem]
    status: str
    database: str
    broker: str


# --- extraction jobs and batches --------------------------------------------------------------

class JobOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Decoding options (structspec.options.RequestOptions); unset ones take the server's defaults
    (STRUCTSPEC_JOB_STRATEGY, STRUCTSPEC_DRAFT_LEN, STRUCTSPEC_MAX_TOKENS, STRUCTSPEC_JOB_TIMEOUT_S)."""

    strategy: Annotated[str, _option("strategy")] | None = None
    draft_len: Annotated[int, _option("draft_len")] | None = None
    temperature: Annotated[float, _option("temperature")] | None = None
    seed: Annotated[int, _option("seed")] | None = None
    max_tokens: Annotated[int, _option("max_tokens")] | None = None
    verbatim: Annotated[bool, _option("verbatim")] | None = None
    chunking: Annotated[str, _option("chunking")] | None = None
    timeout_s: Annotated[int, _option("timeout_s")] | None = None


class ExtractionCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One document, as text (`document`) or as a file (`content`, base64, with `media_type`),
    and either a registered schema's id or an inline JSON Schema."""

    schema_id: str | None = None
    schema: dict[str, Any] | None = None
    document: Annotated[str, msgspec.Meta(
        pattern=NO_NUL, description="the text; no U+0000. Give this or `content`")] | None = None
    content: Annotated[str, msgspec.Meta(
        description="the document's file, base64: a PDF, an image (PNG, JPEG, TIFF; read by OCR, as are "
                    "PDF pages without a text layer), or UTF-8 text (docs/api.md, Document formats). "
                    "Give this or `document`")] | None = None
    file_id: Annotated[str, msgspec.Meta(
        max_length=40, pattern=NO_NUL,
        description="an uploaded file (POST /v1/files) to extract from. Give `document`, `content` or this")] | None = None
    media_type: Annotated[str, msgspec.Meta(
        max_length=200, pattern=NO_NUL,
        description="the media type of `content` (application/pdf, image/png, image/jpeg, image/tiff, "
                    "text/plain); its first bytes decide first",
        examples=["application/pdf"])] | None = None
    options: JobOptions | None = None

    # exactly one of schema_id and schema, and one of document, content and file_id, not null (structspec.api.openapi)
    __openapi_extra__: ClassVar[dict[str, Any]] = {"allOf": [
        Schema(one_of=[Schema(required=["schema_id"], properties={"schema_id": Schema(type=OpenAPIType.STRING)}),
                       Schema(required=["schema"], properties={"schema": Schema(type=OpenAPIType.OBJECT)})]),
        Schema(one_of=[Schema(required=["document"], properties={"document": Schema(type=OpenAPIType.STRING)}),
                       Schema(required=["content"], properties={"content": Schema(type=OpenAPIType.STRING)}),
                       Schema(required=["file_id"], properties={"file_id": Schema(type=OpenAPIType.STRING)})])]}


class JobAccepted(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    status: str


class JobStats(msgspec.Struct, kw_only=True):
    strategy: str | None = None
    draft_len: int | None = None
    output_tokens: int | None = None
    target_passes: int | None = None
    proposed: int | None = None
    accepted: int | None = None
    acceptance_rate: float | None = None
    tokens_per_pass: float | None = None
    verbatim: Annotated[bool, msgspec.Meta(
        description="some string field was limited to document spans (its stats are kept apart)")] | None = None
    chunks: Annotated[int, msgspec.Meta(
        description="the document was extracted in this many chunks (options.chunking auto); null otherwise")] \
        | None = None
    chunks_used: Annotated[int, msgspec.Meta(
        description="chunks whose result contributed a value to the merged result")] | None = None


class JobTimings(msgspec.Struct, kw_only=True):
    queued_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None


class Confidence(msgspec.Struct, kw_only=True):
    min: float
    mean: float


class PageBox(msgspec.Struct, kw_only=True):
    page: Annotated[int, msgspec.Meta(description="1-based page number")]
    box: Annotated[list[float], msgspec.Meta(
        description="[x0, y0, x1, y1] from the page's top-left corner, y downwards: in PDF points for a PDF "
                    "(its scanned pages too), in pixels for an image")]


PHASE = msgspec.Meta(description="reading: the job's file is being read (queued for a reader, or read now; "
                                  "docs/api.md, Document formats); null otherwise")


class JobRead(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    status: Annotated[str, msgspec.Meta(description="queued | running | succeeded | failed | cancelled")]
    phase: Annotated[str | None, PHASE]
    schema_id: uuid.UUID
    batch_id: uuid.UUID | None
    result: Any
    error: str | None
    stats: JobStats | None
    timings: JobTimings
    created_at: datetime
    finished_at: datetime | None
    spans: Annotated[dict[str, list[int] | None] | None, msgspec.Meta(
        description="per string of the result (by JSON Pointer): [start, end) character offsets of where it occurs "
                    "in the document, or null where it does not occur (see docs/api.md, Grounding)")] = None
    confidence: Annotated[dict[str, Confidence] | None, msgspec.Meta(
        description="per leaf of the result (by JSON Pointer): the target model's probabilities of the tokens "
                    "that wrote it, under the grammar's mask (see docs/api.md, Grounding)")] = None
    boxes: Annotated[dict[str, list[PageBox]] | None, msgspec.Meta(
        description="for a document sent as a PDF or an image, per span (by JSON Pointer): the page and box of "
                    "each line the value covers (see docs/api.md, Document formats)")] = None
    warnings: Annotated[list[str] | None, msgspec.Meta(
        description="what reading the job's file had to say (e.g. a page rendered at a lower resolution to stay "
                    "within a limit); null when nothing")] = None


class BatchCreate(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`documents`: objects `{"id"?: str | int, "document": str}` (text) or `{"id"?, "content": str,
    "media_type"?: str}` (a file, base64, as in ExtractionCreate); a bad entry is reported in
    `rejected` and does not sink the others."""

    schema_id: str
    documents: list[Any]
    options: JobOptions | None = None
    webhook_url: Annotated[str, msgspec.Meta(
        max_length=2048, description="POSTed the batch once every job has finished (docs/api.md, Webhooks); "
                                     "its host must be in STRUCTSPEC_WEBHOOK_HOSTS")] | None = None


class Rejected(msgspec.Struct, kw_only=True):
    line: Annotated[int, msgspec.Meta(description="1-based NDJSON line, or 1-based index in `documents`")]
    message: str


class BatchAccepted(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    total: int
    rejected: list[Rejected]


class JobSummary(msgspec.Struct, kw_only=True):
    """A job in a list: no document, result or grounding (GET /v1/extractions/{id} has them)."""

    id: uuid.UUID
    status: Annotated[str, msgspec.Meta(description="queued | running | succeeded | failed | cancelled")]
    phase: Annotated[str | None, PHASE]
    schema_id: uuid.UUID
    batch_id: uuid.UUID | None
    error: str | None
    created_at: datetime
    finished_at: datetime | None


class FileRead(msgspec.Struct, kw_only=True):
    id: Annotated[str, msgspec.Meta(description="file-<hex>: give it as `file_id`")]
    filename: str
    bytes: int
    purpose: str
    media_type: Annotated[str | None, msgspec.Meta(description="as its first bytes (else its label) say")]
    created_at: datetime


class FilePage(msgspec.Struct, kw_only=True):
    items: list[FileRead]
    has_more: Annotated[bool, msgspec.Meta(description="more after the last item: ask again with after=<its id>")]


class JobPage(msgspec.Struct, kw_only=True):
    items: list[JobSummary]
    total: int
    limit: int
    offset: int


class BatchPage(msgspec.Struct, kw_only=True):
    items: list[BatchRead]
    total: int
    limit: int
    offset: int


# --- acceptance statistics ---------------------------------------------------------------------

class StrategyChoice(msgspec.Struct, kw_only=True):
    strategy: str
    draft_len: int


class StrategyPin(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Pin `auto` jobs of a schema to one strategy; strategy "auto" removes the pin."""

    strategy: Annotated[str, msgspec.Meta(description=" | ".join(STRATEGIES),
                                          extra_json_schema=_documented(**option_keywords("strategy", False)))]
    draft_len: Annotated[int, _option("draft_len", describe=False)] | None = None


class ArmStats(msgspec.Struct, kw_only=True):
    strategy: str
    draft_len: int
    requests: int
    output_tokens: int
    target_passes: int
    proposed: int
    accepted: int
    acceptance_rate: float
    tokens_per_pass: float
    tokens_per_second: float
    decode_s: float
    accepted_by_position: list[int]
    proposed_by_position: list[int]
    mean_batch_size: Annotated[float | None, msgspec.Meta(
        description="mean over requests of the sequences decoded together in a job's steps (1: one at a time); "
                    "null before any request")]


class SchemaStats(msgspec.Struct, kw_only=True):
    schema_id: uuid.UUID
    selected: StrategyChoice
    selected_by: Annotated[str, msgspec.Meta(description="pinned | estimate (posterior mean of the selector)")]
    pinned: StrategyChoice | None
    strategies: list[ArmStats]
