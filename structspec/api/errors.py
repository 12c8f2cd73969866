"""One error shape for every non-2xx response:

    {"status_code": 422, "detail": "schema is not usable",
     "errors": [{"path": "/type", "keyword": "anyOf", "message": "...", "source": "schema"}]}

Services raise ApiError subclasses, and the schema registry below them RegistryErrors (404,
413 or 422: `from_registry`); `handle_exception` turns those, Litestar's own
exceptions (routing 404/405, body 400/413, parameter validation) and anything unexpected
(500, logged here, never echoed) into that shape.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

import msgspec
import sqlalchemy.exc as sa_exc
from litestar import MediaType, Request, Response
from litestar.exceptions import (HTTPException, NotFoundException, SerializationException,
                                 ValidationException)

from structspec.services.schemas import RegistryError, SchemaNotFound, SchemaTooLarge

log = logging.getLogger("structspec.api")


class ErrorItem(msgspec.Struct, kw_only=True):
    """One problem. `path` is a JSON pointer into the request body (source "body"), into the
    submitted JSON Schema (source "schema"), or a parameter name (source "query" / "path")."""

    path: str = ""
    keyword: str | None = None  # the JSON Schema keyword at fault, for source "schema"
    message: str
    source: str | None = None  # body | query | path | header | schema | database | broker | rate_limit


class ErrorBody(msgspec.Struct, kw_only=True):
    status_code: int
    detail: str
    errors: list[ErrorItem] = msgspec.field(default_factory=list)


class ApiError(HTTPException):
    """An error with a status code, a one-line detail and itemised problems."""

    def __init__(self, status_code: int, detail: str, errors: list[ErrorItem] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(detail=detail, status_code=status_code, headers=headers)
        self.errors = errors or []


class BadRequestError(ApiError):
    def __init__(self, detail: str, errors: list[ErrorItem] | None = None):
        super().__init__(400, detail, errors)


class NotFoundError(ApiError):
    def __init__(self, detail: str):
        super().__init__(404, detail)


class PayloadTooLargeError(ApiError):
    def __init__(self, detail: str, errors: list[ErrorItem] | None = None):
        super().__init__(413, detail, errors)


class UnprocessableError(ApiError):
    def __init__(self, detail: str, errors: list[ErrorItem] | None = None):
        super().__init__(422, detail, errors)


def from_registry(exc: RegistryError) -> ApiError:
    """The API error of a schema the registry refused: 404 unknown, 413 too large, 422 otherwise."""
    status = 404 if isinstance(exc, SchemaNotFound) else 413 if isinstance(exc, SchemaTooLarge) else 422
    return ApiError(status, exc.detail, [ErrorItem(path=p.path, keyword=p.keyword, message=p.message, source=p.source)
                                         for p in exc.problems])


def error_response(body: ErrorBody, headers: dict[str, str] | None = None) -> Response[ErrorBody]:
    return Response(content=body, status_code=body.status_code, headers=headers, media_type=MediaType.JSON)


def handle_exception(request: Request, exc: Exception) -> Response[ErrorBody]:
    """App-wide handler for every exception (registered for `Exception`)."""
    if isinstance(exc, RegistryError):
        exc = from_registry(exc)
    if isinstance(exc, ApiError):
        return error_response(ErrorBody(status_code=exc.status_code, detail=exc.detail, errors=exc.errors),
                              exc.headers)
    if isinstance(exc, ValidationException):
        return error_response(_from_validation(exc))
    if isinstance(exc, (RecursionError, UnicodeDecodeError)):
        # Raised by the body decoder itself (Litestar passes these through as 500s).
        return error_response(_from_undecodable(exc))
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        return error_response(_from_client_exception(request, exc), exc.headers)  # e.g. Allow on 405
    if is_database_unavailable(exc):
        log.warning("database unavailable in %s %s: %s", request.method, request.url.path, one_line(exc))
        return error_response(database_unavailable(exc), {"retry-after": "5"})
    log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    return error_response(ErrorBody(status_code=status, detail=HTTPStatus(status).phrase.lower()))


def is_database_unavailable(exc: BaseException) -> bool:
    """The database could not be reached or dropped the connection: refused, timed out, closed
    or terminated by the server, or no pooled connection in time. The pool has already
    invalidated a disconnected connection, so the next request gets a fresh one."""
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError,
                        sa_exc.DisconnectionError)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated


def database_unavailable(exc: BaseException) -> ErrorBody:
    return ErrorBody(status_code=503, detail="the database is unavailable; retry later",
                     errors=[ErrorItem(message=one_line(exc), source="database")])


def one_line(exc: BaseException) -> str:
    """The error on one line, at most 300 characters, without SQLAlchemy's SQL and link tail."""
    if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None:
        exc = exc.orig
    return (" ".join(str(exc).split()) or type(exc).__name__)[:300]


_MALFORMED = "JSON is malformed"  # msgspec's prefix, redundant after ours
_MISSING = re.compile(r"Object missing required field `([^`]*)`")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")


def _from_undecodable(exc: Exception) -> ErrorBody:
    if isinstance(exc, RecursionError):
        detail = "request body is nested too deeply"
    else:
        detail = f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}"
    return ErrorBody(status_code=400, detail=detail, errors=[ErrorItem(message=detail, source="body")])


def _from_client_exception(request: Request, exc: HTTPException) -> ErrorBody:
    status, detail = exc.status_code, exc.detail
    if isinstance(exc.__cause__, SerializationException):  # the body did not decode at all
        reason = str(exc.__cause__).removeprefix(_MALFORMED).strip(" :")
        return ErrorBody(status_code=400, detail=f"request body is not valid JSON: {reason}",
                         errors=[ErrorItem(message=reason, source="body")])
    if status == 413:
        limit = request.route_handler.resolve_request_max_body_size() if _has_handler(request) else None
        detail = f"request body is larger than the limit of {limit} bytes" if limit else "request body is too large"
    elif isinstance(exc, NotFoundException) and detail == "Not Found":
        detail = f"no route for {request.method} {request.url.path}"
    elif status == 405:
        detail = f"method {request.method} is not allowed on {request.url.path}"
    return ErrorBody(status_code=status, detail=detail)


def _has_handler(request: Request) -> bool:
    try:
        return request.route_handler is not None
    except Exception:  # no route matched
        return False


def _from_validation(exc: ValidationException) -> ErrorBody:
    """Litestar raises ValidationException (400) for request data that parsed but does not fit
    the handler's types. Well-formed but invalid is 422 here; unparseable stays 400."""
    cause = str(exc.__cause__ or "")
    if "missing required field `data`" in cause:  # no body at all
        return ErrorBody(status_code=400, detail="request body is required (a JSON object)",
                         errors=[ErrorItem(message="request body is empty", source="body")])
    items = [_item(raw) for raw in (exc.extra if isinstance(exc.extra, list) else [])]
    if not items:
        return ErrorBody(status_code=422, detail="invalid request")
    summary = "; ".join(f"{i.path or '/'}: {i.message}" for i in items)
    return ErrorBody(status_code=422, detail=f"invalid request {items[0].source or 'data'}: {summary}",
                     errors=items)


def _item(raw: Any) -> ErrorItem:
    if not isinstance(raw, dict):
        return ErrorItem(message=str(raw))
    message = str(raw.get("message", "invalid value"))
    source = str(getattr(raw.get("source"), "value", raw.get("source") or "")) or None
    key = str(raw.get("key", ""))
    if source == "body":
        parts = [] if key in ("", "data") else key.split(".")
        m = _MISSING.search(message) or _UNKNOWN.search(message)
        if m:
            parts.append(m.group(1))
        path = "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)
    elif source == "header":  # Litestar names the handler's argument: idempotency_key -> Idempotency-Key
        path = "-".join(w.capitalize() for w in key.split("_"))
    else:
        path = key
    return ErrorItem(path=path, message=message, source=source)
