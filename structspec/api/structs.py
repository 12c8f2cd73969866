"""Request and response bodies (msgspec structs). Create/Read pairs per resource."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

import msgspec

from structspec.api.errors import ErrorItem

NAME_PATTERN = r"^[A-Za-z0-9._-]+$"

SchemaName = Annotated[str, msgspec.Meta(
    min_length=1, max_length=200, pattern=NAME_PATTERN,
    description="1-200 characters from A-Z a-z 0-9 . _ -", examples=["invoice"])]


class SchemaCreate(msgspec.Struct, forbid_unknown_fields=True):
    """Register a JSON Schema under a name; new content under an existing name is a new version."""

    name: SchemaName
    schema: Annotated[dict[str, Any], msgspec.Meta(
        description="a JSON Schema (Draft 2020-12 unless $schema says draft-07 or 2019-09)",
        examples=[{"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}])]
    description: Annotated[str, msgspec.Meta(max_length=10_000)] | None = None


class SchemaSummary(msgspec.Struct, kw_only=True):
    id: uuid.UUID
    name: str
    version: int
    hash: Annotated[str, msgspec.Meta(description="sha256 of the schema's canonical JSON")]
    description: str | None
    created_at: datetime
    updated_at: datetime


class SchemaRegistered(SchemaSummary, kw_only=True):
    warnings: list[str] = msgspec.field(default_factory=list)


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
