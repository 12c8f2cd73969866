"""The OpenAI-compatible surface, mounted under /openai/v1 so that it cannot clash with
structspec's own /v1 routes (its /v1/batches in particular): clients set
`base_url="http://host:8000/openai/v1"` and keep their code.

    POST /openai/v1/chat/completions   response_format json_schema | json_object; one job, waited on
    GET  /openai/v1/models             the served model

Each request runs as one extraction job through the usual machinery (API keys, tenants, rate
and size limits, the per-schema statistics and `auto`); its prompt is the request's messages
through the model's chat template, their text as data (engine/prompt.py). Errors take
OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so SDK exceptions carry the
message (`openai_error`, chosen by path in api/app.py).

Not yet here (docs/api.md says so): `stream: true`, and the Files and Batches endpoints.
"""

from __future__ import annotations

import json
import time
from typing import Any

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.datastructures import State
from litestar.params import JSONBody

from structspec.api.errors import ApiError, ErrorBody, ErrorItem, handle_exception
from structspec.api.extractions import provide_job_service
from structspec.api.services.jobs import JobService
from structspec.api.structs import JobOptions
from structspec.config import Settings

PREFIX = "/openai/v1"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
KNOWN_FIELDS = {"model", "messages", "response_format", "max_tokens", "max_completion_tokens", "temperature",
                "seed", "n", "stream", "stream_options", "user", "metadata", "store"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error"}


def served_model(settings: Settings) -> str:
    return DEFAULT_MODEL_ID if settings.model in ("default", "") else settings.model


def bad_request(message: str, param: str | None = None, status: int = 400) -> ApiError:
    return ApiError(status, message, [ErrorItem(path=param or "", message=message, source="body")])


# --- the request ----------------------------------------------------------------------------

def chat_messages(raw: Any) -> list[dict[str, str]]:
    """OpenAI messages as {role, content} with text content; developer counts as system."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array of {role, content}", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(f"{where}: role must be one of {', '.join(sorted(ROLES))}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"{where}: only text content parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"{where}: content must be a string or text parts", f"{where}.content")
        if "\x00" in content:
            raise bad_request(f"{where}: content must not contain U+0000", f"{where}.content")
        out.append({"role": ROLES[m["role"]], "content": content})
    return out


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
    """Decoding options from the request. temperature defaults to 0 (greedy) here, not 1."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    values = {"temperature": body.get("temperature"), "seed": body.get("seed"), "max_tokens": max_tokens}
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise bad_request(f"{name} must be a number", name)
    return JobOptions(temperature=values["temperature"], seed=values["seed"], max_tokens=max_tokens)


def check_request(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise bad_request(f"unsupported parameter {unknown[0]!r}", unknown[0])
    if body.get("n", 1) != 1:
        raise bad_request("n must be 1", "n")
    if body.get("stream"):
        raise bad_request("stream is not supported yet: send the request without stream", "stream")
    return body


# --- the response ---------------------------------------------------------------------------

def completion(job, model: str) -> dict[str, Any]:
    """The chat.completion of a finished job, or an ApiError for one that failed."""
    stats = job.stats or {}
    if job.status == "succeeded":
        content, finish = json.dumps(job.result, ensure_ascii=False, separators=(",", ":")), "stop"
    elif job.status == "failed" and (job.error or "").startswith("truncated:"):
        content, finish = None, "length"  # as OpenAI: the output hit max_tokens (or the context)
    elif (job.error or "").startswith("document too long"):
        raise bad_request(job.error, "messages")
    else:
        raise ApiError(500, f"the extraction failed: {job.error}")
    prompt, output = stats.get("prompt_tokens", 0), stats.get("output_tokens", 0)
    return {
        "id": f"chatcmpl-{job.id.hex}", "object": "chat.completion", "created": int(job.created_at.timestamp()),
        "model": model,
        "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                     "message": {"role": "assistant", "content": content, "refusal": None}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output},
        "structspec": {"job_id": str(job.id), "schema_id": str(job.schema_id),
                       **{k: stats.get(k) for k in ("strategy", "draft_len", "target_passes", "tokens_per_pass",
                                                    "acceptance_rate")}},
    }


class OpenAIController(Controller):
    """Left out of structspec's OpenAPI document: its contract is OpenAI's API reference."""

    path = PREFIX
    include_in_schema = False

    @post("/chat/completions", sync_to_thread=True, status_code=200,
          summary="OpenAI-compatible chat completion with a JSON response_format",
          description="One extraction job, waited on for up to STRUCTSPEC_CHAT_TIMEOUT_S (then 504). The "
                      "response's `structspec` field carries the job id and its speculation stats.")
    def chat_completions(self, request: Request, state: State, data: JSONBody[dict[str, Any]]) -> dict[str, Any]:
        body = check_request(data)
        messages = chat_messages(body.get("messages"))
        schema = response_schema(body.get("response_format"))
        jobs: JobService = provide_job_service(state, request)
        options = jobs.resolve_options(job_options(body))
        job_id = jobs.submit_chat(schema, messages, options, registered_by=f"POST {PREFIX}/chat/completions")
        settings: Settings = state.settings
        job = jobs.wait_record(job_id, settings.chat_timeout_s)
        if job.finished_at is None:
            raise ApiError(504, f"the extraction did not finish within {settings.chat_timeout_s} s "
                                f"(STRUCTSPEC_CHAT_TIMEOUT_S); job {job_id} goes on: GET /v1/extractions/{job_id}")
        return completion(job, served_model(settings))

    @get("/models", sync_to_thread=False, summary="The served model (OpenAI's model list)")
    def models(self, state: State) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model(state.settings), "object": "model",
                                            "created": int(time.time()), "owned_by": "structspec"}]}


def openai_error(request: Request, exc: Exception) -> Response:
    """structspec's error for `exc` (errors.handle_exception), in OpenAI's shape."""
    response = handle_exception(request, exc)
    body: ErrorBody = response.content
    item = body.errors[0] if body.errors else None
    message = body.detail
    if item is not None and item.message and item.message not in message:
        message = f"{message}: {item.message}"
    param = item.path.strip("/").replace("/", ".") or None if item is not None else None
    if param and param.startswith("options."):  # options are top-level parameters here
        param = param.removeprefix("options.")
    return Response(error_body(body.status_code, message, param, item.keyword if item is not None else None),
                    status_code=body.status_code, headers=response.headers, media_type=MediaType.JSON)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}
