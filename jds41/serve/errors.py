"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`, and the handlers that make sure
every failure a client can cause answers 4xx in that shape.

`APIError` is what handlers raise on purpose. `install(app)` maps the framework's own failures onto it: pydantic
validation errors (bad JSON, non-object bodies, missing/null/mistyped fields) become 400, a non-JSON content type
415, unknown routes 404, wrong methods 405. Anything else is a bug: 500 `server_error`, logged with its traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("jds41.serve")

INVALID = "invalid_request_error"
RETRY_AFTER_S = 5  # what 503s tell clients; the load or the queue is expected to move within seconds


class APIError(Exception):
    """An error answered to the client as is. `extra` fields go into the error object (n_prompt_tokens, n_ctx)."""

    def __init__(self, status: int, message: str, type: str = INVALID, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code if code is not None else status
        self.headers, self.extra = headers or {}, extra

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "unavailable_error", code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def context_exceeded(n_prompt: int, n_ctx: int, param: str) -> APIError:
    # Clients (opencode, the openai SDKs' retry logic, LangChain) look for this exact phrase to trim history.
    return APIError(400, f"This model's maximum context length is {n_ctx} tokens. However, your request has "
                    f"{n_prompt} prompt tokens; shorten the prompt so that at least one token can be generated.",
                    "exceed_context_size_error", param, "context_length_exceeded", n_prompt_tokens=n_prompt,
                    n_ctx=n_ctx)


def _loc(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic names union members in the location ("function-after[...]", "list[int]"): not useful to a client.
    parts = [p for p in parts if "[" not in p]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, with the field's dotted path as `param`."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    param = _loc(tuple(first.get("loc", ())))
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        return APIError(400, f"malformed JSON in the request body: {ctx.get('error', first.get('msg'))}")
    if kind == "missing" and param is None:
        return APIError(400, "the request body is empty: expected a JSON object")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        if kind == "value_error":  # a model-level check (schemas.py validators) with its own message
            return APIError(400, msg)
        return APIError(400, "the request body must be a JSON object")  # a list, a string, a number
    return APIError(400, f"{param}: {msg}", param=param)


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True  # FastAPI reads a body without a content type as JSON; so do llama.cpp and vLLM
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if not _is_json(request.headers.get("content-type")):
            return APIError(415, f"Content-Type must be application/json, got "
                            f"{request.headers.get('content-type')!r}", code="unsupported_media_type").response()
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return APIError(404, "not found: no such route", "not_found_error", code="not_found").response()
        if exc.status_code == 405:
            return APIError(405, "method not allowed on this route", code="method_not_allowed",
                            headers=dict(exc.headers or {})).response()
        return APIError(exc.status_code, str(exc.detail), code=exc.status_code,
                        headers=dict(exc.headers or {})).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", "server_error").response()
