"""Schema registry: validate, deduplicate by content, version per name, soft delete."""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from structspec.config import Settings
from structspec.db.models import DEFAULT_TENANT, SchemaRecord
from structspec.db.repositories import SchemaRepository
from structspec.options import SPECS

log = logging.getLogger(__name__)

# msgspec's `pattern` uses re.search, where `$` also matches before a final newline.
_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
# lock_name serializes registrations per name; retries cover a database without such a lock.
_VERSION_RETRIES = 3
# A generous bound on the characters one token writes (the default model's longest is 16-odd): a
# schema whose shortest value is longer than the largest max_tokens times this cannot fit any output.
MAX_TOKEN_CHARS = 64


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing wrong with the input. `path` is a JSON pointer into the registration (source
    "body") or into the submitted JSON Schema (source "schema")."""

    path: str = ""
    keyword: str | None = None  # the JSON Schema keyword at fault, for source "schema"
    message: str
    source: str | None = None


class RegistryError(Exception):
    """Input the registry refuses: `detail` is one line, `problems` itemise it."""

    def __init__(self, detail: str, problems: list[Problem] | None = None):
        super().__init__(detail)
        self.detail = detail
        self.problems = problems or []


class SchemaNotFound(RegistryError):
    """No live schema of this tenant has that id, name or version."""


class SchemaTooLarge(RegistryError):
    """The schema is over max_schema_bytes."""


class SchemaRejected(RegistryError):
    """The name is invalid, or the grammar engine cannot enforce the schema within the limits."""


@dataclass(frozen=True, kw_only=True)
class StoredSchema:
    """One registered schema version. `schema` (the body) is None in listings, which skip it;
    `warnings` are set by `register` only."""

    id: uuid.UUID
    name: str
    version: int
    hash: str
    description: str | None
    created_at: datetime
    updated_at: datetime
    schema: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, r: SchemaRecord, *, body: bool = True, warnings: list[str] = ()) -> "StoredSchema":
        return cls(id=r.id, name=r.name, version=r.version, hash=r.hash, description=r.description,
                   created_at=r.created_at, updated_at=r.updated_at, schema=r.body if body else None,
                   warnings=list(warnings))


class SchemaRegistry:
    """The schemas of one tenant (the caller's API key's; DEFAULT_TENANT with auth off)."""

    def __init__(self, session_factory: sessionmaker[Session], settings: Settings, tenant: str = DEFAULT_TENANT):
        self.session_factory = session_factory
        self.settings = settings
        self.tenant = tenant

    def register(self, name: str, schema: dict[str, Any],
                 description: str | None = None) -> tuple[StoredSchema, bool]:
        """Store `schema` as the next version of `name`; if a live version of that name already
        has the same content, return it instead. Returns (stored, created)."""
        check_name(name)
        warnings = self.check(schema)
        from structspec.grammar import schema_hash

        digest = schema_hash(schema)
        for attempt in range(_VERSION_RETRIES):
            try:
                with self.session_factory.begin() as session:
                    repo = SchemaRepository(session, self.tenant)
                    repo.lock_name(name)
                    existing = repo.find_by_hash(name, digest)
                    if existing is not None:
                        return StoredSchema.of(existing, warnings=warnings), False
                    record = repo.add(name=name, version=repo.max_version(name) + 1,
                                      body=schema, hash_=digest, description=description)
                    return StoredSchema.of(record, warnings=warnings), True
            except IntegrityError:
                if attempt == _VERSION_RETRIES - 1:
                    raise
                log.info("version race on schema %r, retrying", name)
        raise AssertionError("unreachable")

    def check(self, schema: dict[str, Any]) -> list[str]:
        """Every check `register` makes of a body (size, meta-schema, grammar), storing nothing;
        the warnings."""
        self._check_size(schema)
        return check_usable(schema, self.settings)

    def get(self, schema_id: str | uuid.UUID) -> StoredSchema:
        with self.session_factory() as session:
            record = SchemaRepository(session, self.tenant).get(parse_id(schema_id))
            if record is None:
                raise SchemaNotFound(f"no schema with id {schema_id}")
            return StoredSchema.of(record)

    def get_by_name(self, name: str, version: int | None = None) -> StoredSchema:
        with self.session_factory() as session:
            record = SchemaRepository(session, self.tenant).get_by_name(name, version)
            if record is None:
                which = f"version {version} of " if version is not None else ""
                raise SchemaNotFound(f"no schema {which}named {name!r}")
            return StoredSchema.of(record)

    def list(self, *, limit: int, offset: int, name: str | None = None) -> tuple[list[StoredSchema], int]:
        """One page of live versions, by name then newest version, without bodies; and the total."""
        with self.session_factory() as session:
            records, total = SchemaRepository(session, self.tenant).list(limit=limit, offset=offset, name=name)
            return [StoredSchema.of(r, body=False) for r in records], total

    def delete(self, schema_id: str | uuid.UUID) -> None:
        with self.session_factory.begin() as session:
            repo = SchemaRepository(session, self.tenant)
            record = repo.get(parse_id(schema_id))
            if record is None:
                raise SchemaNotFound(f"no schema with id {schema_id}")
            repo.soft_delete(record)

    def _check_size(self, schema: dict[str, Any]) -> None:
        size = len(msgspec.json.encode(schema))
        limit = self.settings.max_schema_bytes
        if size > limit:
            raise SchemaTooLarge(
                f"schema is {size} bytes as compact JSON; the limit is {limit} bytes (max_schema_bytes)",
                [Problem(path="/schema", message=f"{size} bytes > {limit} bytes", source="body")])


def parse_id(schema_id: str | uuid.UUID) -> uuid.UUID:
    """`schema_id` as a UUID; a malformed id is an unknown one (SchemaNotFound naming it)."""
    if isinstance(schema_id, uuid.UUID):
        return schema_id
    try:
        return uuid.UUID(schema_id)
    except ValueError:
        raise SchemaNotFound(f"no schema with id {schema_id!r} (ids are UUIDs)") from None


def check_name(name: str) -> None:
    if not _NAME.fullmatch(name) or not name.strip("."):
        raise SchemaRejected(
            f"invalid schema name {name!r}",
            [Problem(path="/name", message="1-200 characters from A-Z a-z 0-9 . _ -, not only dots",
                     source="body")])


def check_usable(schema: dict[str, Any], settings: Settings | None = None) -> list[str]:
    """SchemaRejected unless the schema is valid JSON Schema that the grammar engine can enforce
    within the configured limits (shape: max_schema_depth, max_schema_nodes; grammar:
    grammar_*) and that allows some output; the warnings ("path [keyword]: what is not
    enforced") otherwise. The shape is checked here; the rest (meta-schema, grammar compile,
    productive check) in a child process killed after grammar_compile_timeout_s (0: no time
    limit), which a crash of the grammar engine cannot take the API down with
    (services/schemacheck.py says why)."""
    from structspec.grammar import SchemaLimitExceeded
    from structspec.grammar.limits import GrammarLimits, check_shape
    from structspec.services.schemacheck import CheckCrashed, CheckTimeout, check_in_child

    settings = settings or Settings()
    limit = settings.grammar_compile_timeout_s
    try:
        check_shape(schema, settings.max_schema_depth, settings.max_schema_nodes)
        max_tokens = int(SPECS["max_tokens"].maximum)
        answer = check_in_child(schema, asdict(GrammarLimits.from_settings(settings)),
                                max_tokens * MAX_TOKEN_CHARS, max_tokens, limit)
    except SchemaLimitExceeded as e:
        raise _rejected(f"schema is over a limit ({e.setting}): {e.problems[0].message}",
                        [p.as_dict() for p in e.problems]) from None
    except RecursionError:
        raise SchemaRejected("schema is not usable", [
            Problem(message="schema is nested too deeply", source="schema")]) from None
    except CheckTimeout:
        log.warning("schema check stopped after %s s: its process was killed (grammar_compile_timeout_s)", limit)
        message = (f"checking and compiling the schema's grammar took longer than {limit} s "
                   f"(setting grammar_compile_timeout_s)")
        raise SchemaRejected(f"schema is over a limit (grammar_compile_timeout_s): {message}", [
            Problem(message=message, source="schema")]) from None
    except CheckCrashed as e:
        log.warning("schema check crashed the grammar engine's process (%s); schema refused", e)
        raise SchemaRejected("schema is not usable", [
            Problem(message=f"the grammar engine crashed on it ({e}); a long chain of $ref can do that",
                    source="schema")]) from None
    if "warnings" in answer:
        return answer["warnings"]
    if "limit" in answer:
        first = answer["problems"][0]["message"]
        raise _rejected(f"schema is over a limit ({answer['limit']}): {first}", answer["problems"])
    if "invalid" in answer:
        raise _rejected("schema is not usable", answer["invalid"])
    if "recursion" in answer:
        raise SchemaRejected("schema is not usable", [
            Problem(message="schema is nested too deeply", source="schema")])
    log.error("check_schema failed unexpectedly (%s); the checker process printed its traceback",
              answer.get("failed"))
    raise SchemaRejected("schema is not usable", [
        Problem(message=f"the grammar engine could not compile it ({answer.get('failed')})", source="schema")])


def _rejected(detail: str, problems: list[dict]) -> SchemaRejected:
    return SchemaRejected(detail, [Problem(path=p["path"], keyword=p["keyword"], message=p["message"],
                                           source="schema") for p in problems])
