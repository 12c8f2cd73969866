"""/v1/schemas: register, read, list and soft-delete JSON Schemas."""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import Controller, Request, Response, delete, get, post, put
from litestar.di import NamedDependency, Provide
from litestar.datastructures import State
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, JSONBody, PathParameter, QueryParameter

from structspec.api.auth import V1_SECURITY
from structspec.api.errors import ErrorBody
from structspec.api.services.stats import StatsService
from structspec.api.structs import (SchemaCreate, SchemaDetail, SchemaPage, SchemaRegistered, SchemaStats,
                                    SchemaSummary, StrategyPin)
from structspec.services.schemas import SchemaRegistry, StoredSchema


# Bounds of the database columns an integer parameter is compared with (PostgreSQL integer and
# bigint; SQLite integers are 64-bit): past them the driver raises instead of finding nothing.
# (2^53 - 1 rather than 2^63 - 1 for bigint: the document states bounds as JSON numbers, exact to 2^53.)
MAX_INT = 2**31 - 1
MAX_OFFSET = 2**53 - 1

# Any string: a malformed id is an unknown id (404 naming it), not "no route".
SchemaId = Annotated[str, PathParameter(description="schema version id (UUID)")]
Schemas = NamedDependency[SchemaRegistry]
Stats = NamedDependency[StatsService]


def provide_schema_registry(state: State, request: Request) -> SchemaRegistry:
    # registry errors become 404/413/422 in structspec/api/errors.py
    return SchemaRegistry(state.session_factory, state.settings, tenant=request.user)  # user: the tenant (api/auth.py)


def provide_stats_service(state: State, request: Request) -> StatsService:
    return StatsService(state.session_factory, state.settings, tenant=request.user)


def as_struct(stored: StoredSchema, struct: type):
    """A registry result as the response struct `struct` (the fields it names)."""
    return msgspec.convert(stored, struct, from_attributes=True)


def _errors(*codes: int) -> dict[int, ResponseSpec]:
    """The documented error responses of a /v1 route: `codes`, plus 401 (every /v1 route needs a
    key once auth is on, structspec/api/auth.py) and 429 (the rate limit, structspec/api/ratelimit.py)."""
    specs = {c: ResponseSpec(data_container=ErrorBody, description="error (see docs/api.md)", generate_examples=False)
             for c in sorted({401, *codes})}
    specs[429] = ResponseSpec(data_container=ErrorBody, generate_examples=False,
                              description="over the client's request rate (rate_limit_per_minute); "
                                          "retry after the Retry-After header's seconds")
    return specs


class SchemaController(Controller):
    path = "/v1/schemas"
    tags = ["schemas"]
    security = V1_SECURITY
    dependencies = {"schemas": Provide(provide_schema_registry, sync_to_thread=False),
                    "stats": Provide(provide_stats_service, sync_to_thread=False)}

    @post("/", sync_to_thread=True, summary="Register a JSON Schema",
          description="201 with a new version; 200 with the existing record when a live version of "
                      "this name already has the same content (key order and whitespace ignored).",
          responses={200: ResponseSpec(data_container=SchemaRegistered, description="already registered",
                                       generate_examples=False),
                     **_errors(400, 413, 422)})
    def register(self, data: JSONBody[SchemaCreate], schemas: Schemas) -> Response[SchemaRegistered]:
        stored, created = schemas.register(data.name, data.schema, data.description)
        return Response(as_struct(stored, SchemaRegistered), status_code=201 if created else 200)

    @get("/", sync_to_thread=True, summary="List live schemas (all versions), by name then newest version",
         responses=_errors(422))
    def list_schemas(self, schemas: Schemas,
                     limit: Annotated[int, QueryParameter(ge=1, le=500)] = 50,
                     offset: Annotated[int, QueryParameter(ge=0, le=MAX_OFFSET)] = 0,
                     name: Annotated[str | None, QueryParameter(description="only this name")] = None) -> SchemaPage:
        page, total = schemas.list(limit=limit, offset=offset, name=name)
        return SchemaPage(items=[as_struct(s, SchemaSummary) for s in page], total=total, limit=limit, offset=offset)

    @get("/{schema_id:str}", sync_to_thread=True, summary="One schema version, with its body",
         responses=_errors(404))
    def get_schema(self, schema_id: SchemaId, schemas: Schemas) -> SchemaDetail:
        return as_struct(schemas.get(schema_id), SchemaDetail)

    @get("/by-name/{name:str}", sync_to_thread=True, summary="Latest live version of a name, or ?version=N",
         responses=_errors(404, 422))
    def get_by_name(self, name: FromPath[str], schemas: Schemas,
                    version: Annotated[int | None, QueryParameter(ge=1, le=MAX_INT)] = None) -> SchemaDetail:
        return as_struct(schemas.get_by_name(name, version), SchemaDetail)

    @delete("/{schema_id:str}", sync_to_thread=True, status_code=204, summary="Soft-delete one version",
            responses=_errors(404))
    def delete_schema(self, schema_id: SchemaId, schemas: Schemas) -> None:
        schemas.delete(schema_id)

    @get("/{schema_id:str}/stats", sync_to_thread=True, summary="Acceptance statistics and the selected strategy",
         description="Totals per (strategy, draft_len) over every job recorded for this schema version, and "
                     "the (strategy, draft_len) that `auto` currently favours (its pin, if set).",
         responses=_errors(404))
    def get_stats(self, schema_id: SchemaId, stats: Stats) -> SchemaStats:
        return stats.get(schema_id)

    @put("/{schema_id:str}/strategy", sync_to_thread=True, summary="Pin (or unpin) the strategy of `auto` jobs",
         description='`{"strategy": "ngram", "draft_len": 6}` pins; `{"strategy": "auto"}` unpins.',
         responses=_errors(404, 422))
    def put_strategy(self, schema_id: SchemaId, data: JSONBody[StrategyPin], stats: Stats) -> SchemaStats:
        return stats.set_pin(schema_id, data)
